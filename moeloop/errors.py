"""What a user gave moeloop was wrong (a config field, a row of a data or prompts file, a command-line flag), as
opposed to a bug. The message names the field, or the file and line; the `moeloop` command prints it without a
traceback and exits 2."""
from __future__ import annotations

import os
import signal


class InputError(ValueError):
    """Bad user input; the message says where (a ValueError, so callers that caught those still do)."""


class UnscorableSample(ValueError):
    """A reward function cannot score this sample on any attempt (its ground truth is missing or malformed): the
    reward pool falls it back at once, without retries, and without counting it against the circuit breaker (the
    reward service is not failing). The built-in rules raise it; a user's `reward.fn` may too."""


def leave_interrupts_to_the_parent() -> None:
    """In a worker process that a run starts (the disaggregated engine, the reward pool's process workers): a Ctrl-C,
    which the terminal sends to the whole process group, ends this process at once and quietly (exit code 130), and
    the run's main process reports it in its one line (`moeloop.cli`) and cleans up. A KeyboardInterrupt here would
    print a traceback from each worker."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signal.SIGINT))
