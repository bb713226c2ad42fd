"""The steps of a run: train, and on its steps log, check, save and evaluate; a NaN rolls back.

Every second of the loop is in one phase of the clock (trainer/observe/clock.py): the data wait, a
save, an evaluation and a profile's read-back inside a step are booked as themselves, the rest of the
iteration as the step.
"""

import contextlib
import time

import jax
import numpy as np

from data import pipeline
from errors import UserError
from trainer import hooks as hooks_lib
from trainer.cadence import ByClock, CopyCadence, CopyPolicy, itstime
from trainer.checkpoint import restore, store
from trainer.checks import integrity
from trainer.evaluate import evaluate, evaluators
from trainer.observe import flops, profiling, recovery_time, straggler
from trainer.observe.metrics import Window, console, eval_line, progress_line


def empty_batch_error(t: int) -> UserError:
  return UserError(f"global batch {t} has no valid examples (all weights 0); refusing an empty step")


class Loop:
  """What the steps change as they go: the state, the step, the data position (`batch_offset`,
  `rollbacks`), the open metrics window, and what the summary reports."""

  def __init__(self, run, start: restore.Start, integrity_checks, preemption, restarted: dict | None):
    self.run, self.clock, self.config = run, run.clock, run.config
    self.state, self.batch_offset, self.rollbacks = start.state, start.batch_offset, start.rollbacks
    self.start = self.step = int(self.state.step)
    self.last_step = run.last_step
    self.checks, self.preemption, self.restarted = integrity_checks, preemption, restarted
    self.profile = profiling.ProfileWindow(self.config.profile, run.workdir, self.start)
    self.unit = run.comp.experiment.UNIT
    # A rerun that only finishes the evaluation and summary reports the loss the run ended with.
    self.last = run.log.last_train_row(self.start) if self.start >= self.last_step else {}
    self.eval_row, self._eval_compiled, self._stragglers_seen = {}, False, set()
    self.trained = np.zeros(max(self.last_step - self.start, 0))  # Valid units per step of this run.
    c = self.config
    self.timed_saves = ByClock("checkpoint", c.checkpoint.every_s, c.log_every, c.watchdog.step_timeout_s)
    self.timed_saves.begin(self.start, self.rollbacks)
    policy = CopyPolicy.of(c.checkpoint.local_every) if run.local is not None else CopyPolicy()
    checked_every = integrity.interval(run.comp, c)  # No copies: none checked either.
    self.copies = CopyCadence(policy, c.log_every, c.watchdog.step_timeout_s, checked_every)
    self.copies.begin(self.start, self.rollbacks)
    made = hooks_lib.load(run.comp.experiment, c)
    self.hooks = hooks_lib.Hooks(made, c, run.workdir, run.comp.mdef, run.log, c.watchdog.step_timeout_s)
    self.hooks.begin(self.start, self.rollbacks)
    self.evaluators = evaluators(run.comp, c) if c.eval_steps else []
    self._new_window()
    self.batches = self._open_batches()

  def _new_window(self) -> None:
    self.window = self.clock.window = Window(self.unit)

  def _open_batches(self) -> pipeline.DevicePrefetch:
    # Global batch t trains step t - batch_offset + 1.
    return self.run.input.open(self.step + self.batch_offset, self.last_step + self.batch_offset)

  def run_steps(self) -> None:
    try:
      while self.step < self.last_step:
        with self.clock.phase("step", self.step + 1, self._first_step_budget()) as phase:
          stop, metrics, copied, t1 = self._train_step(phase)
          log_now = itstime(self.step, self.config.log_every, self.last_step, last=True) or stop
          save_now = self._saves(self.step) or stop
          # The last step is saved to the persistent tier, always: a copy of it would only stand in for it.
          copy_now = self.copies.due(self.step) or self.copies.checked(self.step)
          copy_now = copy_now and self.step != self.last_step
          # Never log past, or save, a non-finite state (a copy checks on its own thread: no wait here).
          bad = self.window.first_nonfinite_step() if log_now or save_now else None
          if bad is None:
            self._after_step(phase.batch, metrics, copied, t1, log_now, save_now, copy_now, stop)
        if bad is not None:
          self._roll_back(*bad)
        elif stop:
          break
    finally:
      self.profile.abort()
      self.batches.close()
      with self.clock.phase("checkpoint", self.step):  # Even on an error: a good checkpoint in flight
        self.run.ckpt.wait()  # is finished, not left half-written.
        if self.run.local is not None:
          self.run.local.wait(raise_error=False)

  def _saves(self, step: int) -> bool:
    """Whether `step` saves on schedule: every checkpoint.every steps, the last step, and by the clock
    (checkpoint.every_s). Known before the step runs (the recompute check copies its state then)."""
    every = self.config.checkpoint.every
    return itstime(step, every, self.last_step, last=True) or self.timed_saves.due(step)

  def _first_step_budget(self) -> float | None:
    """The run's first step waits in its collectives for peers still compiling: compile's budget."""
    return self.config.watchdog.compile_timeout_s if self.step == self.start else None

  def _train_step(self, phase):
    """One step, never waiting for the devices: a device-to-host copy here (a hidden sync) is an error.
    Only logging, saving and evaluating fetch values, on their steps."""
    run = self.run
    if self.profile.starts_after(self.step):
      with self.clock.phase("profiling", self.step):
        self.profile.start(self.state)
    with jax.transfer_guard_device_to_host("disallow_explicit"):
      with self.clock.phase("data", self.step + 1, self._first_step_budget()):
        t, local, batch = next(self.batches)
      phase.batch = t
      assert t == self.step + self.batch_offset, (
        t,
        self.step,
        self.batch_offset,
      )  # The data position is the step.
      # A globally empty batch never reaches the devices. Rows are known globally from the plan; weights
      # are known here only for this process's rows (with several processes, a count of 0 shows as a
      # non-finite step).
      if run.comp.plan.valid_rows(t) == 0 or (jax.process_count() == 1 and not local["weights"].any()):
        raise empty_batch_error(t)
      t1 = time.time()
      # The run's first step is checks.first_step's when it is on (trainer/checks/first_step.py): another
      # program than the loop's, so the recompute check, which compares bits, does not take that step.
      step_fn, run.first_train_step = run.first_train_step or run.train_step, None
      copied = None
      if step_fn is run.train_step:
        # Before the step donates the state.
        copied = self.checks.copy_if_due(self.step + 1, self.state, batch, self._saves(self.step + 1))
      with self.profile.annotation(self.step + 1):
        self.state, metrics = step_fn(self.state, batch)
      if run.local is not None:  # A copy in flight starts its next part's transfers beside this step.
        run.local.stepped()
      self.step += 1
      self.window.add_step(
        self.step,
        self.batches.last_starved_s,
        dispatch_s=time.time() - t1,
        metrics=metrics,
        valid_examples=run.comp.plan.valid_rows(t),
      )
      run.ckpt.poll()  # A background save's error surfaces here, at the next step.
      if self.restarted and self.step == self.start + 1:  # Time to recover: up to this first step's end.
        jax.block_until_ready(metrics)
        row = recovery_time.row(
          self.restarted, run.clock.ledger.started, run.startup, time.time(), self.start
        )
        run.log.write(row)  # Kept by later resumes.
        console(recovery_time.line(row))
      # Same decisions on every process: the step count and the agreed preemption step.
      return self.preemption.should_stop(self.step), metrics, copied, t1

  def _after_step(
    self, t: int, metrics, copied, t1: float, log_now: bool, save_now: bool, copy_now: bool, stop: bool
  ) -> None:
    """A logged step's window closes after its save, so its checkpoint blocking is in its own row, and a
    new window opens after the evaluation: no window's throughput includes either."""
    run, step, config = self.run, self.step, self.config
    if log_now:
      metrics = jax.device_get(metrics)  # Blocks until this step has run on the device.
      device_wait_s = time.time() - t1
    checked = self.checks.due(step, save_now, copied)
    if checked:  # Before saving: never save a state that differs.
      with self.clock.phase("checkpoint", step):  # Counted with checkpoint blocking: it guards the save.
        try:
          self.checks.run(self.state, metrics, step, copied)
        except BaseException:
          if run.local is not None:  # Back to the newest checked state: the persistent tier's.
            run.local.discard_after(run.ckpt.manager.latest_step() or 0)
          raise
    if copy_now:  # The local and peer tiers: copied on the devices now, the rest in the background.
      # The previous copy first: its thread waits for its step, then writes while the devices run the
      # next one (queued already), so this wait is the pipeline's, booked with the step.
      run.local.wait()
      with self.clock.phase("checkpoint", step):
        position = self._position(step, ended=False)
        run.local.save(step, self.state, position, checked, self.window.unchecked_flags())
    if save_now:
      with self.clock.phase("checkpoint", step):
        position = self._position(step, ended=step == self.last_step or stop)
        run.ckpt.save(step, self.state, position, config, run.meta)  # Async: written in the background.
      self.clock.ledger.saved(step)
      self.timed_saves.ran()
    if log_now:
      self.timed_saves.decide(step)  # Whether the next logging step saves by the clock (process 0).
      self._log(step, t, metrics, device_wait_s)
      if run.local is not None:  # How often the local tier copies (process 0), from the row just written.
        local = run.local
        self.copies.decide(
          step, local.work_s, self.last["step_time_s"], local.waited_s, local.busy_s, local.span_s
        )
    if itstime(step, config.eval_every) and step != config.steps:
      with self._saved_if_fork_code_fails(step, save_now):
        self.eval_row = self.evaluate(step)
      console(f"step {step}/{config.steps}  {eval_line(self.eval_row)}")
    for hook in self.hooks.due(step, self.last_step):
      with self.clock.phase("hooks", step), self._saved_if_fork_code_fails(step, save_now):
        self.hooks.run(hook, step, self.state)
    if log_now:
      self._new_window()
    if copy_now:  # The step's rows are written: its copy may become whole.
      run.local.release()
    if self.profile.ends_after(step):
      with self.clock.phase("profiling", step):
        row = self.profile.stop(self.state)
        run.log.write_process(row)
        profiling.print_table(row, config.watchdog.step_timeout_s, run.device_label)

  @contextlib.contextmanager
  def _saved_if_fork_code_fails(self, step: int, saved: bool):
    """A hook or an evaluator that raises ends the run; nothing is lost: every process saves this
    step (unless it just did, or its state is not finite), then stops."""
    try:
      yield
    except hooks_lib.HookFailed:
      # Never a non-finite state (the steps since the last check, checked now): the last save stands.
      if not saved and self.window.first_nonfinite_step() is None:
        self.run.ckpt.save(step, self.state, self._position(step, ended=True), self.config, self.run.meta)
      raise

  def _position(self, step: int, ended: bool) -> dict:
    """What a checkpoint or copy of `step` saves beside the state: the data position and the clock
    (`ended`: the run stops at this save, so the time until a resume is no loss)."""
    clock = self.clock.snapshot(ended)
    return store.data_position(step, self.batch_offset, self.run.comp, self.rollbacks, clock)

  def _log(self, step: int, t: int, metrics, device_wait_s: float) -> None:
    run = self.run
    row, process_row = self.window.close(step, metrics, device_wait_s)
    row["batch"] = t  # The data position this step trained on: checkable after any restart.
    row.update(flops.fields(run.flops_per_step, row["step_time_s"], run.devices))
    row.update(
      straggler.report(self.clock.watchdog, self.window, step, self.config.straggler, self._stragglers_seen)
    )
    run.log.write(row)
    for record in [process_row, *run.ckpt.drain()]:
      run.log.write_process(record)
    self._count_trained(self.window.step_counts, step)
    eta = (self.config.steps - step) * row["step_time_s"]
    console(progress_line(step, self.config.steps, row["loss"], self.unit, row[f"{self.unit}_per_s"], eta))
    self.last = row

  def evaluate(self, at: int) -> dict:
    """Evaluates and logs at step `at`; the first evaluation compiles the evaluation step."""
    w = self.config.watchdog
    with self.clock.phase("eval", at, w.step_timeout_s if self._eval_compiled else w.compile_timeout_s):
      # Each evaluator within the longest budget the watchdog grants: its length is the fork's task's.
      watch = lambda: self.clock.watchdog.beat("eval", at, w.compile_timeout_s)
      row = evaluate(self.run.comp, self.run.eval_step, self.state, self.config, at, self.evaluators, watch)
    self._eval_compiled = True
    self.run.log.write({"step": at, "time": time.time(), **row})
    return row

  def _count_trained(self, step_counts, up_to: int) -> None:
    for at, n in step_counts:
      if self.start < at <= up_to:  # (A rollback to before this run's start retrains earlier steps.)
        self.trained[at - self.start - 1] = n

  def _roll_back(self, bad: int, empty: bool) -> None:
    """Step `bad` is non-finite: back to the newest good checkpoint, or an error."""
    run, step, c = self.run, self.step, self.config.checkpoint
    if empty:  # With several processes no one process knows it before the step: the same error.
      raise empty_batch_error(bad - 1 + self.batch_offset)
    if c.on_nonfinite != "rollback" or self.rollbacks >= c.max_rollbacks:
      raise UserError(
        f"loss or gradient norm is NaN/Inf at step {bad} (window {step - self.window.steps + 1}..{step}); "
        "lower optimizer.learning_rate, or set checkpoint.on_nonfinite=rollback"
      )
    self.rollbacks += 1  # Saved with the next checkpoint: a restarted job does not start counting afresh.
    self.profile.abort()  # The window would count the steps it trains again.
    self.batches.close()
    with self.clock.phase("restore", step):
      back = restore.roll_back(
        run.ckpt, run.target, run.comp, self.config, run.init, bad, self.batch_offset, time.time()
      )
      self.clock.ledger.discard_after(back.step)
      if run.local is not None:  # Copies of the abandoned steps must not be resumed from.
        run.local.discard_after(back.step)
      self._count_trained(self.window.fetch_counts(), back.step)  # Steps up to the checkpoint stay trained.
      self.trained[max(back.step - self.start, 0) :] = 0  # Later steps' work is thrown away.
      run.log.truncate(back.step)
      run.log.write(back.event)
      self.state, self.step, self.batch_offset = back.state, back.step, back.batch_offset
      self.timed_saves.begin(self.step, self.rollbacks)
      self.copies.begin(self.step, self.rollbacks)
      self.hooks.begin(self.step, self.rollbacks)
      self._new_window()
      self.batches = self._open_batches()
