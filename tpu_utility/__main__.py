"""`python -m tpu_utility doctor` (what to check when a TPU run fails) and
`python -m tpu_utility port SCRIPT.py|NOTEBOOK.ipynb` (the swaps, written next to it)."""
import sys

USAGE = """usage: python -m tpu_utility doctor | port SCRIPT.py|NOTEBOOK.ipynb ...

  doctor   what this host has, and what to check when a TPU run fails
  port     writes SCRIPT_tpu.py with the swaps made, and lists what it left
           (python -m tpu_utility port --help)"""

if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["doctor"] and len(sys.argv) == 2:
        from .environment import doctor
        sys.exit(doctor())
    if command == ["port"]:
        from .port import main
        sys.exit(main(sys.argv[2:]))
    if command in (["-h"], ["--help"]):
        print(USAGE)
        sys.exit(0)
    print(USAGE, file=sys.stderr)
    sys.exit(2)
