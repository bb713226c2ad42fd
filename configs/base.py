"""The trainer's config keys, with their defaults and a one-line meaning; other configs import it.

`get_config(EXPERIMENT)` adds the experiment's own keys (`default_config()` in experiments/NAME.py,
commented there) and locks the result: a key defined neither here nor there is an error. Values only.
"""

import ml_collections

from trainer import configuration


def get_config(experiment: str = "lm") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # One seed for init, dropout and data order.
  c.experiment = experiment  # Module name under experiments/: what is trained (model, loss, data).
  c.steps = 100  # Optimizer steps to train.
  c.global_batch_size = 32  # Examples per optimizer step, over all processes.
  c.microbatches = 1  # Gradient-accumulation steps per optimizer step (sums accumulate, divide once).
  c.log_every = 10  # Write a metrics row and a progress line every N steps.
  c.eval_every = 0  # Evaluate on the held-out split every N steps (0: only at the end).
  c.eval_steps = 2  # Batches per evaluation.
  # Persistent compilation cache: a restart (or a rerun) loads the compiled step instead of compiling it
  # again. '' : WORKDIR/compilation_cache; 'off': none; else a directory, e.g. one shared by runs.
  # JAX_COMPILATION_CACHE_DIR in the environment, if set, wins. A changed `steps` (the schedule) misses.
  c.compilation_cache = ""

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # Data-parallel axis size within a host; -1: all remaining devices.
  c.mesh.fsdp = 1  # Fully-sharded data-parallel axis size within a host.
  c.mesh.tensor = 1  # Tensor-parallel axis size within a host.
  c.mesh.dcn_data = 1  # Data-parallel axis size across hosts or slices (outer, slow links).
  c.mesh.dcn_fsdp = 1  # FSDP axis size across hosts or slices.

  c.sharding = ml_collections.ConfigDict()
  # How parameters, gradients and optimizer state are placed; presets in trainer/sharding.py:
  # 'dp' (replicated), 'zero1' (optimizer state sharded over the batch axes), 'fsdp' (ZeRO-3),
  # 'fsdp_tp' (ZeRO-3 plus tensor parallelism over the tensor axis).
  c.sharding.strategy = "fsdp_tp"
  # Overrides of the preset: (logical axis, mesh axes) pairs, e.g. (("mlp", None),). Model code names
  # logical axes only: weights embed, mlp, heads, kv, norm; activations batch, act_*; and the
  # experiment's own (its LOGICAL_AXES).
  c.sharding.rules = ()
  # fsdp, fsdp_tp: a parameter of at least this many elements is split over the fsdp axis even where
  # its logical axes do not say so (along its largest dimension that can take it).
  c.sharding.fsdp_min_size = 2**14

  c.data = ml_collections.ConfigDict()  # The experiment adds its source's keys (data.source, ...).
  c.data.allow_changed_data = False  # Resume even if the data's fingerprint differs from the checkpoint's.
  c.data.worker_processes = 0  # Grain worker processes preparing batches (0: reader threads only).
  c.data.read_threads = 2  # Host threads that prepare batches ahead of the device.
  c.data.prefetch = 2  # Batches prepared ahead of the one being trained on.

  c.model = ml_collections.ConfigDict()  # The experiment adds its model's keys (sizes, ...).
  # Activations and matmuls: 'float32' or 'bfloat16'; params stay float32. --mode=verify's tolerance
  # follows it.
  c.model.compute_dtype = "float32"

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"  # Only adamw for now.
  c.optimizer.learning_rate = 3e-3  # Peak learning rate.
  c.optimizer.warmup_steps = 20  # Linear warm-up from 0 to the peak.
  c.optimizer.schedule = "cosine"  # After warm-up: 'cosine' (to end_factor * peak) or 'constant'.
  c.optimizer.end_factor = 0.1  # Final learning rate as a fraction of the peak.
  c.optimizer.b1 = 0.9  # Adam beta1.
  c.optimizer.b2 = 0.95  # Adam beta2.
  c.optimizer.weight_decay = 0.1  # Decoupled weight decay on matrices (not on norms or biases).
  c.optimizer.grad_clip_norm = 1.0  # Clip the global gradient norm to this (0: no clipping).

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # Save every N steps (and always at the end).
  c.checkpoint.keep = 3  # How many recent checkpoints to keep.
  c.checkpoint.keep_every = (
    0  # Also keep every checkpoint whose step is a multiple of this, forever (0: none).
  )
  c.checkpoint.on_nonfinite = "stop"  # NaN/Inf loss or grad norm: 'stop' with an error, or 'rollback'.
  c.checkpoint.max_rollbacks = 3  # 'rollback': give up with an error after this many.
  c.checkpoint.replica_parallel = (
    False  # Split replicated shards' writes across replicas (see checkpointing.py).
  )
  # Resume although these keys differ from the checkpoint's, e.g. 'seed,global_batch_size': keys that
  # change the data order are refused otherwise (trainer/resume_policy.py).
  c.checkpoint.allow_changed_keys = ""

  c.watchdog = ml_collections.ConfigDict()
  # Each phase has its own budget; past it the job ends with a report naming the stuck process.
  c.watchdog.startup_timeout_s = 600.0  # Building the mesh, data and model, and agreeing with peers.
  c.watchdog.restore_timeout_s = 600.0  # Reading a checkpoint (at start-up and on a rollback).
  c.watchdog.compile_timeout_s = 600.0  # Compiling the step, and the first step (peers still compile).
  c.watchdog.step_timeout_s = 300.0  # A step, barrier, save or evaluation.
  # A peer whose liveness counter (trainer/liveness.py, its own thread, whatever the phase) has not
  # moved for this long is lost: stopped, dead or partitioned away. Every process names what it lost and
  # exits 3. Must stay below JAX's heartbeat timeout (100 s unless set), which aborts without a name.
  c.watchdog.peer_timeout_s = 30.0

  c.checks = ml_collections.ConfigDict()
  # Every N steps and before every checkpoint, compare checksums of every copy of each replicated
  # array of the train state (trainer/replicas.py); a device whose copy differs stops the run (exit 4)
  # before it saves. 0: never. About 6 ms per check for the smoke model on 8 logical CPU devices.
  c.checks.replica_every = 0
  # Every N steps and on every scheduled save, run the step a second time from a copy of its state and
  # batch with each shard on another device of the same process, and compare bit for bit
  # (trainer/recompute.py): what catches a device computing wrong where nothing is replicated (pure
  # FSDP). Costs one more step and a copy of the state on the checked steps. 0: never.
  c.checks.recompute_every = 0

  c.profile = ml_collections.ConfigDict()
  # A JAX profiler trace of steps start_step+1 .. start_step+steps on every process, in
  # WORKDIR/profile/process_I (TensorBoard's profile plugin, or Perfetto), read back into each
  # process's compute / collective / wait / idle split (processes/process_I.jsonl and a console table).
  c.profile.start_step = 5  # The window begins after this step (of the run's own count: warm-up first).
  c.profile.steps = 0  # Steps traced; 0: no profile.

  c.straggler = ml_collections.ConfigDict()
  # One line names a process whose data wait or step dispatch time per step (over a logging window) exceeds
  # the median of the other processes' by this factor, and by at least min_s. 0: never.
  c.straggler.factor = 3.0
  c.straggler.min_s = 0.05  # Seconds per step: smaller differences are noise.

  # Adds the experiment's keys, then locks: a config that sets a key defined nowhere fails on load.
  return configuration.with_experiment(c, experiment)
