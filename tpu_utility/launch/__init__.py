"""The launch: `run(train_fn, cores=8)` from the caller's side to each replica process and
back, one file each.

| file | one concern |
| --- | --- |
| parent.py | `run` and `run_replicas`: arguments checked, the engine chosen, its processes started and watched |
| child.py | the child's entry: a replica process readied, train_fn run, its result or error reported |
| results.py | result collection: the master's result on the CPU, replica errors, silent exits, stopping every process |
| exits.py | how far each replica process got, and what `run` says when one leaves before the others |
| children.py | child processes that die with the parent, and what they started |
| stall.py | `run(stall_timeout=)`: heartbeats, stack dumps, `Stalled` |
| preemption.py | SIGTERM: replicas agree on a step, checkpoint, raise `Preempted` |

Nothing is imported here, so that importing one of these (the replica record imports
preemption.py) does not import the rest.
"""
