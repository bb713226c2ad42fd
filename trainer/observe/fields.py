"""Every field a run writes, declared once with its meaning: the rows of metrics.jsonl (process 0) and
of each processes/process_I.jsonl, and summary.json. `make docs` writes docs/reference/metrics.md from
it (docs/generate.py); tests/test_metrics_reference.py trains a tiny run and checks what it wrote
against it both ways, so a field added to a row without its line here fails there.

A name's upper-case words stand for names the run chooses (PLACEHOLDERS): `valid_UNIT` is `valid_`
and the experiment's UNIT. A field with a `when` is written only then; the others are in every row of
their kind. An experiment declares its own metrics (what METRIC stands for) as Fields in its METRICS.
Needs no JAX (the docs build imports it).
"""

import dataclasses

from trainer.observe.collectives import KINDS

METRICS, PROCESS, SUMMARY = "metrics.jsonl", "processes/process_I.jsonl", "summary.json"


@dataclasses.dataclass(frozen=True)
class Field:
  name: str  # The key, or a pattern of PLACEHOLDERS (`eval_METRIC`).
  doc: str  # What it means, in a line.
  when: str = ""  # Written only then; "": in every row of its kind.
  of: str = ""  # A kind (ROWS) that declares the keys of its value, a dict ...
  each: bool = False  # ... or of each of its items: a list's, or a dict's by name (a device's id).


@dataclasses.dataclass(frozen=True)
class Rows:
  file: str  # METRICS, PROCESS, SUMMARY; "" for a value nested in another kind's field.
  event: str | None  # The row's "event" (a row without one: None).
  doc: str
  fields: tuple[Field, ...]
  also: str = ""  # Another kind whose fields it carries too, step and time excepted ...
  also_when: str = ""  # ... only then ("": always).


PLACEHOLDERS = {
  "UNIT": "What the loss's count counts: the experiment's UNIT.",
  "METRIC": "Each metric the experiment's loss_sums returns (its METRICS declare them).",
  "SET": "A weight set evaluation scores beside the params: `ema` (ema.decay > 0), or a name the "
  "experiment's eval_weights gives.",
  "NAME": "A named held-out set, the experiment's eval_sets (the LM: each data set of a mixture, by name).",
  "TASK": "An evaluator, by its name (the experiment's evaluators; the LM's data.eval_tasks, each task).",
  "SCORE": "A metric an evaluator returns (the LM's tasks: `acc`, `acc_norm`, `exact_match`).",
  "HOOK": "A hook, by its name (the experiment's hooks; trainer/hooks.py).",
  "KEY": "A key a hook wrote through ctx.writer.",
  "KIND": "A collective kind: " + ", ".join(f"`{k}`" for k in KINDS) + ".",
  "NN": "A number, two digits (`00`), in an experiment's metric's name.",
}
# Placeholders whose names the trainer fixes: no run has others.
FIXED = {"KIND": KINDS}

_TRAIN = (
  Field("step", "The step the window ends at: the step logged."),
  Field("time", "Unix time the window closed."),
  Field("batch", "The global batch the step trained on (its data position): checkable after any restart."),
  Field("loss", "The step's training loss: its summed loss divided by its global valid count."),
  Field("grad_norm", "The global norm of the step's gradients, divided by the count, before clipping."),
  Field("learning_rate", "The learning rate the schedule gave the step."),
  Field("METRIC", "Each of the experiment's metrics at the step: its sum divided by the global valid count."),
  Field("valid_UNIT", "Valid UNITs (the loss's count) over the window's steps."),
  Field("valid_examples", "Examples (batch rows that hold a record) over the window's steps."),
  Field(
    "step_time_s", "Seconds per step over the window, its saving, evaluating, hooks and profiling left out."
  ),
  Field("data_wait_s", "Seconds per step the loop waited for its next batch (an input stall)."),
  Field("UNIT_per_s", "Valid UNITs per second over the window, on the time step_time_s counts."),
  Field(
    "tflops_per_device",
    "Model TFLOP/s per device: model FLOPs per step / step_time_s / devices / 1e12.",
    "the step's FLOPs are known (the experiment's model_flops_per_example, else XLA's count)",
  ),
  Field(
    "mfu",
    "tflops_per_device as a fraction of the device's peak (trainer/observe/hardware.py).",
    "the device kind has a peak (never logical CPU devices)",
  ),
  Field(
    "stragglers",
    "The processes slower than the others over the window (trainer/observe/straggler.py).",
    "several processes, and one of them is a straggler",
  ),
)

# When an evaluation row has more than the params' scores on the experiment's held-out data.
_SETS = "ema.decay > 0, or eval_weights names sets"
_NAMED = "the experiment has named held-out sets (an LM mixture)"
_TASKS = "the experiment has evaluators (the LM: data.eval_tasks)"
_EVAL = (
  Field("step", "The step evaluated."),
  Field("time", "Unix time the evaluation ended."),
  Field("eval_loss", "The held-out loss of the params (of eval_weights' set '', where it names its own)."),
  Field("eval_METRIC", "Each of the experiment's metrics on the held-out data."),
  Field("eval_examples", "Held-out examples evaluated, each once (a smaller set is not wrapped around)."),
  Field("eval_SET_loss", "The held-out loss of weight set SET.", _SETS),
  Field("eval_SET_METRIC", "Each of the experiment's metrics, of weight set SET.", _SETS),
  Field("eval_NAME_loss", "The loss on held-out set NAME.", _NAMED),
  Field("eval_NAME_METRIC", "Each of the experiment's metrics on held-out set NAME.", _NAMED),
  Field("eval_NAME_examples", "Examples of held-out set NAME evaluated.", _NAMED),
  Field("eval_NAME_SET_loss", "The loss on held-out set NAME of weight set SET.", f"{_NAMED}; {_SETS}"),
  Field("eval_NAME_SET_METRIC", "Each metric on held-out set NAME, of weight set SET.", f"{_NAMED}; {_SETS}"),
  Field("eval_TASK_SCORE", "Evaluator TASK's metric SCORE for the params (trainer/hooks.Evaluator).", _TASKS),
  Field("eval_SET_TASK_SCORE", "Evaluator TASK's metric SCORE for weight set SET.", f"{_TASKS}; {_SETS}"),
)

_RECOVERY = (
  Field("step", "The step the restarted run resumed from."),
  Field("time", "Unix time its first step completed."),
  Field("event", '`"recovery"`'),
  Field("restart", "The restart's number: 1 for the launcher's first."),
  Field("cause", "How the process that failed first ended, in words ('killed by SIGKILL')."),
  Field("process", "The process that failed first."),
  Field("processes", "The restarted job's processes (one fewer where a slot did not come back)."),
  Field("detection_s", "The first death to the whole old job being down: its peers noticing and stopping."),
  Field("relaunch_s", "To this process's start: the launcher's back-off and spawning."),
  Field("startup_s", "Imports and building (mesh, data, model), to the restore."),
  Field("restore_s", "Reading the checkpoint onto this mesh."),
  Field("compile_s", "Compiling the step (a warm compilation cache loads it)."),
  Field("first_step_s", "Opening the data and the first step, to its completion."),
  Field("total_s", "The death to the first completed step."),
)

_STARTUP = (
  Field("imports", "From the process's start to train(): imports and flags (main.py's clock; 0 in-process)."),
  Field("build", "Building the mesh, the experiment, the data order, the optimizer and the shardings."),
  Field("init", "Looking for a checkpoint, and a fresh sharded init.", "no checkpoint was restored"),
  Field("restore", "Reading the checkpoint (or a local copy) onto this mesh.", "a checkpoint was restored"),
  Field("compile", "Compiling the train step ahead of time (the compilation cache may serve it)."),
  Field(
    "first_step_check",
    "Compiling checks.first_step's two programs for the first step.",
    "checks.first_step compiled them (no record of this program passing)",
  ),
)

# goodput's categories: each second is booked once, in the clock's phase it is spent in
# (trainer/observe/clock.py).
_GOODPUT = (
  Field("startup", "Imports, building, a fresh init, opening the data."),
  Field("restore", "Reading a checkpoint."),
  Field("compile", "Compiling the step, and checks.first_step's programs."),
  Field("profiling", "Starting, stopping and reading back the profile window's trace."),
  Field("data_wait", "The loop taking its next batch."),
  Field("productive_steps", "The steps, beyond their data wait, saving, evaluating, hooks and profiling."),
  Field(
    "checkpoint_blocking",
    "The loop's share of saving (the rest is written in the background), checks guarding it, the last write.",
  ),
  Field("evaluation", "Evaluating."),
  Field("hooks", "The experiment's hooks."),
  Field(
    "lost_to_restarts",
    "From the checkpoint a resume started from to its start: lost work and downtime (none after an end).",
  ),
  Field("lost_to_rollbacks", "Steps a NaN/Inf rollback threw away."),
  Field(
    "wall_s",
    "The wall time it splits: every run of the workdir, restarts included (this run's: from its start).",
  ),
  Field("unaccounted_s", "wall_s less the categories' sum: a few hundredths at most."),
  Field("goodput", "productive_steps / wall_s (null for no wall time)."),
)

_SPLIT = (
  Field("compute_s", "Computing, per step (on CPU: waiting for a core included)."),
  Field("KIND_s", "In collectives of KIND, per step (not counted twice where they overlap).", "KIND ran"),
  Field("wait_s", "Waiting for the other devices inside a collective, per step (XLA:CPU's traces only)."),
  Field("idle_s", "Running nothing, per step: the rest of the window's span."),
)

_SUMMARY = (
  Field("final_step", "The step the run ended at."),
  Field("final_loss", "The training loss of the last logged step (null: this run has none)."),
  Field("loss_floor", "The data's known loss floor, the synthetic chain's entropy rate (null: unknown)."),
  Field(
    "examples_seen", "Examples in the global batches before the final data position, skipped ones included."
  ),
  Field(
    "UNIT_trained_this_run", "Valid UNITs this run's steps trained (steps a rollback threw away excluded)."
  ),
  Field("nonfinite_rollbacks", "NaN/Inf rollbacks over the whole run, restarts included."),
  Field("preempted_by", "The signal that stopped the run ('SIGTERM'; null: none)."),
  Field("wall_s", "Seconds from train()'s call to the summary, this run."),
  Field("compile_s", "Seconds compiling the train step, this run (startup_s.compile)."),
  Field("startup_s", "This run's start-up seconds by part.", of="startup"),
  Field("goodput", "Where the wall time of every run of the workdir went, restarts included.", of="goodput"),
  Field("goodput_this_run", "... and this run's, from its process's start.", of="goodput"),
  Field(
    "recoveries",
    "Every recovery row of metrics.jsonl: each restart's time to recover.",
    of="recovery",
    each=True,
  ),
  Field(
    "model_flops_per_step",
    "FLOPs per step over the global batch, MFU's numerator: the experiment's count, else XLA's (null: none).",
  ),
  Field(
    "compiled_flops_per_step",
    "XLA's count of the compiled step's FLOPs, all devices: remat included, a loop's body once (null: none).",
  ),
  Field(
    "tflops_per_device", "Model TFLOP/s per device over this run's steps, all their time (null: none ran)."
  ),
  Field("mfu", "tflops_per_device as a fraction of the device's peak, or why there is none ('n/a (...)')."),
  Field("devices", "The devices, in words ('8 x cpu (logical CPU devices ...)', '8 x NVIDIA H200')."),
  Field("processes", "The run's processes."),
)

ROWS = {
  "train": Rows(
    METRICS,
    None,
    "One per logged step (every log_every steps, the last step, a step a signal stops at), for the "
    "window of steps since the one before. Counts are over the window; the loss, grad_norm, "
    "learning_rate and the experiment's metrics are the logged step's.",
    _TRAIN,
  ),
  "eval": Rows(
    METRICS,
    None,
    "One per evaluation (eval_steps > 0): every eval_every steps and at the final step, over up to "
    "eval_steps batches of each held-out set, summed and divided once by their count "
    "(trainer/evaluate.py).",
    _EVAL,
  ),
  "start": Rows(
    METRICS,
    "start",
    "One at every start, fresh or resumed (a resumed run first drops the rows past its checkpoint).",
    (
      Field("step", "The step the run starts from: 0, or its checkpoint's."),
      Field("time", "Unix time."),
      Field("event", '`"start"`'),
      Field("processes", "The run's processes (a processes/ file of a higher number is an earlier run's)."),
    ),
  ),
  "recovery": Rows(
    METRICS,
    "recovery",
    "A process a launcher restarted (launch/local.py --max_restarts) writes one after its first step: "
    "the time to recover, by phase (trainer/observe/recovery_time.py). Later resumes keep it.",
    _RECOVERY,
  ),
  "nonfinite_rollback": Rows(
    METRICS,
    "nonfinite_rollback",
    "A NaN/Inf step rolled back to the newest good checkpoint (checkpoint.on_nonfinite=rollback).",
    (
      Field("step", "The checkpoint rolled back to: training goes on from it."),
      Field("time", "Unix time of the rollback."),
      Field("event", '`"nonfinite_rollback"`'),
      Field("nonfinite_step", "The first non-finite step."),
      Field("skipped_batches", "[first, last]: the global batches that led there, skipped from now on."),
    ),
  ),
  "hook": Rows(
    METRICS,
    "hook",
    "One per run of a hook that wrote something (trainer/hooks.py).",
    (
      Field("step", "The step it ran at."),
      Field("time", "Unix time it finished."),
      Field("event", '`"hook"`'),
      Field("hook", "The hook's name."),
      Field("HOOK/KEY", "What it wrote: a number, a text, or an image's PNG path under the workdir."),
    ),
  ),
  "process_start": Rows(
    PROCESS,
    "start",
    "One at every start of the process, once it has built, restored and compiled (launchers read it).",
    (
      Field("step", "The step the run starts from."),
      Field("time", "Unix time."),
      Field("event", '`"start"`'),
      Field("startup_s", "Its start-up seconds by part.", of="startup"),
      Field("compiled_from_cache", "Whether the persistent compilation cache served the train step."),
    ),
  ),
  "window": Rows(
    PROCESS,
    None,
    "One per logged window, in this process's seconds over the whole window (not per step).",
    (
      Field("step", "The step the window ends at."),
      Field("time", "Unix time the window closed."),
      Field("process", "This process's index."),
      Field("steps", "Steps in the window."),
      Field("data_wait_s", "Waiting for the next batch because it was not ready (an input stall)."),
      Field(
        "batch_fetch_s", "Taking batches, all of it (waiting for the GIL behind other host threads included)."
      ),
      Field("dispatch_s", "Handing the steps to the devices."),
      Field("device_wait_s", "From the logged step's dispatch until its metrics reached the host."),
      Field(
        "checkpoint_block_s",
        "Saving, copying to the local tier and the checks guarding them (the last step's save included).",
      ),
      Field("eval_s", "Evaluating."),
      Field("hooks_s", "In the experiment's hooks."),
    ),
  ),
  "checkpoint": Rows(
    PROCESS,
    "checkpoint",
    "One per save, once the loop finds it written: after that window's row, or at the run's end.",
    (
      Field("event", '`"checkpoint"`'),
      Field("step", "The step saved."),
      Field("blocking_s", "Seconds the loop was blocked starting the save (the copy off the devices)."),
      Field("write_s", "Seconds from the save's start until the loop found it written."),
    ),
  ),
  "profile": Rows(
    PROCESS,
    "profile",
    "The profile window's split of each device's time (profile.steps > 0; trainer/observe/profiling.py).",
    (
      Field("step", "The window's last step."),
      Field("time", "Unix time the trace stopped."),
      Field("event", '`"profile"`'),
      Field("steps", "[first, last]: the steps traced."),
      Field("trace", "The trace file read (the .xplane.pb).", "the profiler wrote one"),
      Field("note", "What this backend's trace can show ('' off CPU), or why there is no split."),
      Field("span_s", "The window's span per step.", "the trace has per-device op events"),
      Field(
        "devices",
        "Each local device's split, by its global id.",
        "the trace has per-device op events",
        "split",
        True,
      ),
      Field(
        "mean",
        "The split averaged over this process's devices.",
        "the trace has per-device op events",
        "split",
      ),
      Field(
        "top_ops", "The ops that took the most time.", "the trace has per-device op events", "top_op", True
      ),
    ),
  ),
  "summary": Rows(
    SUMMARY,
    None,
    "Written at the end of training (process 0), whole or not at all.",
    _SUMMARY,
    also="eval",
    also_when="this run evaluated: its last evaluation's",
  ),
  "startup": Rows("", None, "Start-up's seconds by part (startup_s).", _STARTUP),
  "goodput": Rows(
    "",
    None,
    "Where wall time went (trainer/observe/goodput.py), in seconds, each second in one category.",
    _GOODPUT,
  ),
  "split": Rows("", None, "One device's time in the profile window, per step.", _SPLIT),
  "top_op": Rows(
    "",
    None,
    "One of the ops that took the most time.",
    (
      Field("op", "The HLO op's name."),
      Field("s", "Its seconds per step, averaged over the devices (a collective's wait included)."),
    ),
  ),
}
