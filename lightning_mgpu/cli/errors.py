"""Turning a refusal into what the command-line tools print: the problem list on stderr, exit status 2.

:class:`ConfigError` carries every problem of a refused configuration or command line; :func:`exit_on_refusal` runs
a console entry point and prints only the problems of such a refusal (``HYDRA_FULL_ERROR=1`` shows tracebacks);
:func:`refusal_message` words Hydra's and OmegaConf's own composition errors the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import sys
from typing import Callable, Iterator, NoReturn, Optional, Sequence


from lightning_mgpu.checkpoint.formats import CheckpointRefusedError
from lightning_mgpu.checkpoint.safe_reader import UnsafeCheckpointError
from lightning_mgpu.problems import format_problems
# the exit statuses the elastic agent tells apart, kept importable here
from lightning_mgpu.resilience.restarts import EXIT_CRASH_LOOP, EXIT_REFUSED  # noqa: F401


class ConfigError(ValueError):
    """A refused configuration: every problem, one line each (the command-line tools print them and exit 2)."""

    def __init__(self, problems: Sequence[str], what: str = "configuration") -> None:
        self.problems = list(problems)
        super().__init__(format_problems(f"Invalid {what}", self.problems))


def did_you_mean(key: str, known, prefix: str = "") -> str:
    """``"; did you mean trainer.max_steps?"`` for the closest names, or nothing."""
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""




#: Set to 1 to see the traceback behind a refused configuration (Hydra's own switch for its errors).
FULL_ERROR = "HYDRA_FULL_ERROR"


_reporting = False  # True while exit_on_refusal runs an entry point and the user did not ask for tracebacks


def exit_on_refusal(entry: Callable[[], object]) -> None:
    """Run a console entry point: a refused configuration or command line prints only its problems on stderr and
    exits with status 2; any other error keeps its traceback. ``HYDRA_FULL_ERROR=1`` shows every traceback."""
    global _reporting
    if os.environ.get(FULL_ERROR) == "1":
        entry()
        return
    os.environ[FULL_ERROR] = "1"  # Hydra then raises its composition errors instead of printing them and exiting 1
    _reporting = True
    try:
        entry()
    except Exception as err:
        message = refusal_message(err)
        if message is None:
            raise
        _refuse(message)
    finally:
        os.environ.pop(FULL_ERROR, None)
        _reporting = False


@contextlib.contextmanager
def refusal_exits() -> Iterator[None]:
    """Around the body of a Hydra task function: a :class:`ConfigError` exits at once, before Hydra reports a failed
    job ("Error executing job with overrides ...") and re-raises it."""
    try:
        yield
    except ConfigError as err:
        if not _reporting:
            raise
        _refuse(str(err))


def _refuse(message: str) -> NoReturn:
    sys.stderr.write(message + "\n")
    raise SystemExit(EXIT_REFUSED) from None


#: Config keys that were renamed to the constructor argument they set: old key -> new key.
RENAMED = {"parallel.timeout_s": "parallel.timeout", "checkpoint.consolidated": "checkpoint.save_consolidated_weights",
           # keys that are not lightning.Trainer arguments left the trainer group
           "trainer.throughput": "throughput.enabled", "trainer.peak_flops": "throughput.peak_flops",
           "trainer.check_memory": "cluster.check_memory"}


def refusal_message(err: BaseException) -> Optional[str]:
    """What to tell a user whose configuration or command line was refused; None for any other error."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(err, (ConfigError, CheckpointRefusedError, UnsafeCheckpointError)):
        return str(err)
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        options = list(err.options or group_options(group))
        line = f"{group}={name} is not an option of {group}"
        if options:
            line += f"; choose one of {', '.join(options)}{did_you_mean(name, options)}"
        return format_problems("Invalid command line", [line])
    if isinstance(err, OverrideParseException):
        why = "; ".join(line.strip() for line in err.message.splitlines()
                        if line.strip() not in ("", "^") and not line.startswith(("Error parsing", "See ")))
        return (format_problems("Invalid command line", [f"{err.override!r} is not an override: {why}"])
                + "\n(overrides are key=value, e.g. trainer.devices=2 or model=tiny; --help lists the options)")
    if isinstance(err, ConfigCompositionException):
        cause = err.__cause__
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key in RENAMED:
            return format_problems("Invalid command line", [
                f"{cause.full_key} was renamed {RENAMED[cause.full_key]} (where the object it configures takes it); use that"])
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
            parent = cause.full_key.rsplit(".", 1)[0] + "." if "." in cause.full_key else ""
            hint = did_you_mean(str(cause.key), _fields(cause.object_type), parent)
            return format_problems("Invalid command line", [f"{cause.full_key} is not a setting{hint}"])
        if isinstance(cause, ValidationError) and cause.full_key:
            return format_problems("Invalid command line", [f"{cause.full_key}: {cause.msg.splitlines()[0]}"])
        detail = f": {cause}" if isinstance(cause, OmegaConfBaseException) else ""
        return format_problems("Invalid command line", [f"{err}{detail}"])
    if isinstance(err, AssertionError) and "Unexpected type for root: NoneType" in str(err):
        # OmegaConf's update of a key below a null node, e.g. logger.wandb.project=x while logger=wandb is not selected
        return format_problems("Invalid command line", [
            "a key is set inside a config node that is null: select its option first (logger.wandb.project=x needs "
            "logger=wandb or logger=[csv,wandb]), or give the whole node"])
    return None


def _fields(schema) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def group_options(group: str) -> list[str]:
    """The options of a config group of ``conf/`` (or the recipes), by name."""
    from lightning_mgpu.cli.paths import conf_dir, recipes_dir

    folder = recipes_dir() if group == "recipe" else conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def run_rank(entry: Callable[[], object]) -> object:
    """One rank of a job on the elastic agent: ``entry()``; a refusal is said as ``mgpu-train`` says it and exits with
    :data:`EXIT_REFUSED`, which the agent does not restart."""
    try:
        return entry()
    except Exception as error:
        message = refusal_message(error)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_REFUSED) from None
