"""`python -m moeloop` == the `moeloop` command (torchrun -m moeloop rl ...)."""
import sys

from moeloop.cli import main

sys.exit(main())
