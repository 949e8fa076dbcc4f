"""`python -m tpu_utility doctor`: what to check when a TPU run fails."""
import sys

from .environment import doctor

if __name__ == "__main__":
    if sys.argv[1:] != ["doctor"]:
        print("usage: python -m tpu_utility doctor", file=sys.stderr)
        sys.exit(2)
    sys.exit(doctor())
