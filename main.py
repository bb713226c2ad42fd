"""Train, evaluate, inspect or verify an experiment described by an ml_collections config.

  python main.py --config=configs/smoke_cpu.py --workdir=runs/smoke --cpu_devices=8

The only file that defines flags. Mistakes a user can make end with one `error:` line.
"""

import os
import re
import sys

import exit_codes
from trainer.cluster import interrupts

interrupts.install()  # Before anything slow is imported: a signal from here on is one line, not a traceback.
for _stream in (sys.stdout, sys.stderr):
  # One write per line, flushed at its end (PYTHONUNBUFFERED writes a print's text and its newline
  # apart, and a C++ library's line landing between them merges two lines in the launcher's output).
  _stream.reconfigure(line_buffering=True, write_through=False)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/smoke_cpu.py[:ARG].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, summary.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "inspect", "verify"], "What to do.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None, "Run on N logical CPU devices.")
_TARGET_DEVICE = flags.DEFINE_string(
  "target_device", None, "--mode=inspect: compare per-device memory with this device's (h100, h200, v5p...)."
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in the job.")
_PATHWAYS = flags.DEFINE_bool(
  "pathways",
  False,
  "Single controller on Pathways (TPUs on GKE): needs pathwaysutils and JAX_BACKEND_TARGET.",
)
_INIT_TIMEOUT = flags.DEFINE_integer(
  "distributed_init_timeout_s", None, "Seconds to wait for every process to join (JAX default 300)."
)
_CPU_COLLECTIVES_INTERFACE = flags.DEFINE_string(
  "cpu_collectives_interface",
  None,
  "Network interface whose address Gloo (collectives between CPU processes) advertises; default: the "
  "address the host name resolves to.",
)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
  "distributed_heartbeat_timeout_s", None, "Seconds before a silent peer ends the job (JAX default 100)."
)


def _fail(msg: str, code: int = exit_codes.USER_EXIT) -> None:
  print(f"error: {msg}", file=sys.stderr, flush=True)
  if path := os.environ.get("EXIT_CODE_FILE"):  # For a scheduler that sees only the job's combined code.
    try:
      with open(path, "w") as f:
        f.write(f"{code}\n")
    except OSError:
      pass
  if (runtime := sys.modules.get("trainer.cluster.runtime")) is not None:
    runtime.exit_now_if_joined(code)  # Not to wait at JAX's shutdown barrier for peers blocked on it.
  sys.exit(code)


def _interrupted(e: interrupts.Interrupted) -> None:
  print(e.line(), file=sys.stderr, flush=True)
  sys.stdout.flush()
  if (runtime := sys.modules.get("trainer.cluster.runtime")) is not None:
    runtime.exit_now_if_joined(e.exit_code)  # Process 0 last: its peers' lines are printed too.
  # At once: threads of Orbax or Grain may be mid-flight, and a joined process would otherwise wait
  # at JAX's shutdown barrier for peers. Nothing was being written that a restart needs.
  os._exit(e.exit_code)


def _parse_flags(argv):
  """absl's parser, with its errors (unknown or misspelt config keys among them) as `error:` lines."""
  from errors import UserError

  try:
    return flags.FLAGS(argv)
  except interrupts.Interrupted as e:  # Loading the config file imports the experiment, and JAX.
    _interrupted(e)
  except UserError as e:  # A config argument (`:tiny,fsdp=8`) or an experiment that is not there.
    _fail(str(e))
  except flags.Error as e:
    _fail(_one_line(str(e)) or repr(e))
  except (AttributeError, KeyError) as e:  # A config (file or override) naming a key declared nowhere.
    _fail(_unknown_key(str(e)))
  except Exception as e:  # A config file that fails to load.
    _fail(_one_line(f"{type(e).__name__}: {e}"))


def _unknown_key(msg: str) -> str:
  """ml_collections' message (a repr nested in a repr, with the whole config) cut to what to change."""
  key = re.search(r"""Key \\?["'](\w+)""", msg) or re.search(r"^\W*(\w+)", msg)
  hint = re.search(r"""Did you mean \\?["'](\w+)""", msg)
  name = key.group(1) if key else "?"
  suggestion = f"; did you mean {hint.group(1)!r}?" if hint else ""
  return (
    f"unknown config key {name!r}{suggestion} (keys are declared in trainer/config/trainer_keys.py "
    "and the experiment's experiments/NAME_keys.py)"
  )


def _one_line(msg: str) -> str:
  return "; ".join(line.strip() for line in msg.strip().splitlines() if line.strip())


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}")
  if _CONFIG.value is None or not _WORKDIR.value:
    _fail("--config and --workdir are required")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO.
  from errors import UserError

  if _MODE.value != "train":
    interrupts.during(f"--mode={_MODE.value}")
  if _TARGET_DEVICE.value and _MODE.value != "inspect":
    _fail(f"--target_device is for --mode=inspect, not --mode={_MODE.value}")
  try:
    from trainer.cluster import pathways, runtime

    if pathways.requested(_PATHWAYS.value):
      if _CPU_DEVICES.value or any(f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)):
        raise UserError(
          "--pathways runs one process that drives every TPU: drop --cpu_devices and the "
          "--coordinator_address/--num_processes/--process_id flags"
        )
      pathways.initialize()  # Instead of join_job: no jax.distributed, one controller process.
    else:
      if _CONFIG.value.checks.recompute_every:  # Its equal bits need deterministic GPU kernels.
        runtime.use_deterministic_gpu_ops()
      runtime.configure_cpu_devices(_CPU_DEVICES.value)
      runtime.use_cpu_collectives_interface(_CPU_COLLECTIVES_INTERFACE.value)
      runtime.join_job(
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
        init_timeout_s=_INIT_TIMEOUT.value,
        heartbeat_timeout_s=_HEARTBEAT_TIMEOUT.value,
      )
    from trainer.run import run

    given = set(config_flags.get_override_values(flags.FLAGS["config"]))
    run(_CONFIG.value, _WORKDIR.value, _MODE.value, target_device=_TARGET_DEVICE.value, given=given)
  except interrupts.Interrupted as e:
    _interrupted(e)
  except Exception as e:  # noqa: BLE001 - classified (trainer/cluster/failures.py), else the traceback.
    from trainer.cluster import failures

    if (line := failures.error_line(e, _WORKDIR.value)) is None:
      raise
    _fail(*line)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
