"""The trainer's config keys, each declared once: default, rule, what resuming with another value does,
and its meaning (trainer/config/keys.py). configs/base.py's get_config() builds the config from them and
the experiment's own (experiments/NAME_keys.py). JAX-free: config files load it.
"""

from trainer.config import keys
from trainer.config.keys import Key
from trainer.config.rules import boolean, mesh_size, name, one_of, pairs, real, text, whole

# trainer/sharding.py's presets (it checks that they are these).
STRATEGIES = ("dp", "fsdp", "fsdp_tp", "zero1")

KEYS = {
  "seed": Key(
    0,
    whole(0, 2**32 - 1),
    keys.refused("the data order and every random draw (dropout) change"),
    "One seed for init, dropout and data order.",
    program=False,
  ),
  "experiment": Key(
    "lm",
    name,
    keys.refused("another experiment's model and loss"),
    "Module name under experiments/: what is trained (model, loss, data).",
  ),
  "init_from": Key(
    "",
    text,
    keys.FREE,
    "Initial params: a Hugging Face model directory the experiment reads (the LM: Llama's config.json "
    "and safetensors), or another run's workdir (its newest checkpoint). Step 0, a fresh optimizer; the "
    "shape keys come from config.json. Ignored once the workdir has checkpoints (trainer/init_from.py).",
    program=False,
  ),
  "steps": Key(
    100,
    whole(1),
    keys.changes("the learning-rate schedule now ends at the new step count, so the learning rate differs"),
    "Optimizer steps to train.",
    program=False,
  ),
  "global_batch_size": Key(
    32,
    whole(1),
    keys.refused("global batch t holds other examples: some are trained twice, some never"),
    "Examples per optimizer step, over all processes.",
  ),
  "microbatches": Key(
    1, whole(1), keys.FREE, "Gradient-accumulation steps per optimizer step (sums accumulate, divide once)."
  ),
  "log_every": Key(
    10, whole(1), keys.FREE, "Write a metrics row and a progress line every N steps.", program=False
  ),
  "eval_every": Key(
    0,
    whole(0),
    keys.FREE,
    "Evaluate on the held-out split every N steps (0: only at the end).",
    program=False,
  ),
  "eval_steps": Key(2, whole(0), keys.FREE, "Batches per evaluation.", program=False),
  "ema.decay": Key(
    0.0,
    real(0.0, 1.0, high_open=True),
    keys.changes("the average weighs the steps after this one differently"),
    "Keep an exponential moving average of the params (ema = decay * ema + (1 - decay) * params after "
    "every step, from the initial params, not debiased), evaluated beside them; 0: none. Turning it on "
    "or off needs a new --workdir: the checkpoint holds the average or not.",
  ),
  "compilation_cache": Key(
    "",
    text,
    keys.FREE,
    "Persistent compilation cache: a restart, a rerun or a new run of a program compiled before loads it"
    " instead of compiling it again. '': one cache shared by this user's runs on this host "
    "($XDG_CACHE_HOME or ~/.cache, then jax-template/compilation; JAX's keys hold the program, the jax "
    "version, the devices and XLA flags, so anything else misses); 'workdir': WORKDIR/compilation_cache; "
    "'off': none; else a directory. At most 8 GiB, least recently used first out. "
    "JAX_COMPILATION_CACHE_DIR in the environment, if set, wins. A changed `steps` hits: the run's length "
    "is an argument of the train step.",
    program=False,
  ),
  "mesh.data": Key(
    -1, mesh_size, keys.FREE, "Data-parallel axis size within a host; -1: all remaining devices."
  ),
  "mesh.fsdp": Key(1, mesh_size, keys.FREE, "Fully-sharded data-parallel axis size within a host."),
  "mesh.expert": Key(
    1,
    mesh_size,
    keys.FREE,
    "Expert-parallel axis size within a host: a mixture of experts' experts are split over it (the "
    "batch too), and routed rows reach their experts by all-to-all. 1 for dense models.",
  ),
  "mesh.context": Key(
    1,
    mesh_size,
    keys.FREE,
    "Context-parallel axis size within a host: every activation's sequence is split over it and attention "
    "reaches across by a ring or an all-gather (model.context_attention); 1: whole sequences.",
  ),
  "mesh.tensor": Key(1, mesh_size, keys.FREE, "Tensor-parallel axis size within a host."),
  "mesh.dcn_data": Key(
    1, whole(1), keys.FREE, "Data-parallel axis size across hosts or slices (outer, slow links)."
  ),
  "mesh.dcn_fsdp": Key(1, whole(1), keys.FREE, "FSDP axis size across hosts or slices."),
  "mesh.dcn_expert": Key(
    1, whole(1), keys.FREE, "Expert axis size across hosts or slices (its all-to-all crosses them)."
  ),
  "sharding.strategy": Key(
    "fsdp_tp",
    one_of(*STRATEGIES),
    keys.FREE,
    "How parameters, gradients and optimizer state are placed; presets in trainer/sharding.py: 'dp' "
    "(replicated), 'zero1' (optimizer state sharded over the batch axes), 'fsdp' (ZeRO-3), 'fsdp_tp' "
    "(ZeRO-3 plus tensor parallelism over the tensor axis).",
  ),
  "sharding.rules": Key(
    (),
    pairs,
    keys.FREE,
    'Overrides of the preset: (logical axis, mesh axes) pairs, e.g. (("mlp", None),). Model code names '
    "logical axes only: weights embed, mlp, heads, kv, norm; activations batch, act_*; and the "
    "experiment's own (its LOGICAL_AXES); a name none of these know is an error.",
  ),
  "sharding.fsdp_min_size": Key(
    2**14,
    whole(0),
    keys.FREE,
    "fsdp, fsdp_tp: a parameter of at least this many elements is split over the fsdp axis even where its"
    " logical axes do not say so (along its largest dimension that can take it).",
  ),
  # The experiment adds its source's keys (data.source, ...).
  "data.allow_changed_data": Key(
    False,
    boolean,
    keys.FREE,
    "Resume even if the data's fingerprint differs from the checkpoint's.",
    program=False,
  ),
  "data.worker_processes": Key(
    0,
    whole(0),
    keys.FREE,
    "Grain worker processes preparing batches (0: reader threads only).",
    program=False,
  ),
  "data.read_threads": Key(
    0,
    whole(0),
    keys.FREE,
    "Grain reader threads preparing batches; 0: the thread that puts batches on the devices reads them "
    "too (on the TPU v5e reader threads slowed every dispatch: docs/guides/tpu.md).",
    program=False,
  ),
  "data.prefetch": Key(
    2,
    whole(1),
    keys.FREE,
    "Batches prepared ahead of the one being trained on; with reader threads, at least one per thread.",
    program=False,
  ),
  # The experiment adds its model's keys (sizes, ...).
  "model.compute_dtype": Key(
    "float32",
    one_of("float32", "bfloat16"),
    keys.MODEL,
    "Activations and matmuls: 'float32' or 'bfloat16'; params stay float32. --mode=verify's tolerance "
    "follows it.",
  ),
  "optimizer.name": Key("adamw", one_of("adamw"), keys.OPTIMIZER, "Only adamw for now."),
  "optimizer.learning_rate": Key(3e-3, real(0.0, low_open=True), keys.OPTIMIZER, "Peak learning rate."),
  "optimizer.warmup_steps": Key(20, whole(0), keys.OPTIMIZER, "Linear warm-up from 0 to the peak."),
  "optimizer.schedule": Key(
    "cosine",
    one_of("cosine", "constant"),
    keys.OPTIMIZER,
    "After warm-up: 'cosine' (to end_factor * peak) or 'constant'.",
  ),
  "optimizer.end_factor": Key(
    0.1, real(0.0, 1.0), keys.OPTIMIZER, "Final learning rate as a fraction of the peak."
  ),
  "optimizer.b1": Key(0.9, real(0.0, 1.0, high_open=True), keys.OPTIMIZER, "Adam beta1."),
  "optimizer.b2": Key(0.95, real(0.0, 1.0, high_open=True), keys.OPTIMIZER, "Adam beta2."),
  "optimizer.weight_decay": Key(
    0.1, real(0.0), keys.OPTIMIZER, "Decoupled weight decay on matrices (not on norms or biases)."
  ),
  "optimizer.moments_dtype": Key(
    "float32",
    one_of("float32", "bfloat16"),
    keys.OPTIMIZER,
    "AdamW's two moments: 'float32', or 'bfloat16' (half the optimizer's memory; computed in float32 "
    "each step; with b2 near 1 the second moment's increments fall below bfloat16's resolution).",
  ),
  "optimizer.grad_clip_norm": Key(
    1.0, real(0.0), keys.OPTIMIZER, "Clip the global gradient norm to this (0: no clipping)."
  ),
  "checkpoint.every": Key(
    50, whole(1), keys.FREE, "Save every N steps (and always at the end).", program=False
  ),
  "checkpoint.every_s": Key(
    0.0,
    real(0.0),
    keys.FREE,
    "Also save at least every this many seconds, on a logging step: process 0 decides at each logging "
    "step whether the next one saves, and every process reads it there (trainer/cadence.py), so a slow "
    "model still saves on time. 0: by steps only.",
    program=False,
  ),
  "checkpoint.keep": Key(3, whole(1), keys.FREE, "How many recent checkpoints to keep.", program=False),
  "checkpoint.keep_every": Key(
    0,
    whole(0),
    keys.FREE,
    "Also keep every checkpoint whose step is a multiple of this, forever (0: none).",
    program=False,
  ),
  "checkpoint.local_every": Key(
    -1,
    whole(-1),
    keys.FREE,
    "Copy each process's shards to checkpoint.local_dir and to a partner process every N steps: a lost "
    "host costs at most N steps and a copy's steps in flight. -1: as often as measured copies allow, "
    "each change said in a line (trainer/cadence.py); off with a warning where local_dir lacks room. 0: off.",
    program=False,
  ),
  "checkpoint.local_pace_mib": Key(
    64.0,
    real(0.0),
    keys.FREE,
    "A local-tier copy is brought to host memory this many MiB at a time, a part per step the loop "
    "dispatches, so that its transfers run beside the steps (on a TPU a step dispatched behind a whole "
    "copy's transfers waited for them); 0: all at once. A copy then takes about its size / this steps, "
    "unless the loop waits for it (the next copy, the run's end) or takes no step for 0.1 s (a part goes "
    "then: a stalled loop never holds a copy back).",
    program=False,
  ),
  "checkpoint.local_copy_in": Key(
    "auto",
    one_of("auto", "device", "host"),
    keys.FREE,
    "Where a local-tier copy is taken. device: a copy on the devices, brought to host memory beside the "
    "next steps (one more state in device memory meanwhile); host: straight into pinned host memory (no "
    "device memory; the next step waits for the transfers); auto: device unless the compiled step and "
    "one more state exceed 90% of a device's memory (said at the start and in --mode=inspect).",
    program=False,
  ),
  "checkpoint.local_dir": Key(
    "",
    text,
    keys.FREE,
    "Host-local folder of the local and peer tiers ('': a per-run folder under /dev/shm, host memory).",
    program=False,
  ),
  "checkpoint.on_nonfinite": Key(
    "stop",
    one_of("stop", "rollback"),
    keys.FREE,
    "NaN/Inf loss or grad norm: 'stop' with an error, or 'rollback'.",
    program=False,
  ),
  "checkpoint.max_rollbacks": Key(
    3, whole(0), keys.FREE, "'rollback': give up with an error after this many.", program=False
  ),
  "checkpoint.replica_parallel": Key(
    False,
    boolean,
    keys.FREE,
    "Split replicated shards' writes across replicas (see trainer/checkpoint/store.py).",
    program=False,
  ),
  "checkpoint.allow_changed_keys": Key(
    "",
    text,
    keys.FREE,
    "Resume although these keys differ from the checkpoint's, e.g. 'seed,global_batch_size': keys that "
    "change the data order are refused otherwise (trainer/config/resume.py).",
    program=False,
  ),
  # Each phase has its own budget; past it the job ends with a report naming the stuck process.
  "watchdog.startup_timeout_s": Key(
    600.0,
    real(0.0, low_open=True),
    keys.FREE,
    "Building the mesh, data and model, and agreeing with peers.",
    program=False,
  ),
  "watchdog.restore_timeout_s": Key(
    600.0,
    real(0.0, low_open=True),
    keys.FREE,
    "Reading a checkpoint (at start-up and on a rollback).",
    program=False,
  ),
  "watchdog.compile_timeout_s": Key(
    600.0,
    real(0.0, low_open=True),
    keys.FREE,
    "Compiling the step, and the first step (peers still compile).",
    program=False,
  ),
  "watchdog.step_timeout_s": Key(
    300.0, real(0.0, low_open=True), keys.FREE, "A step, barrier, save or evaluation.", program=False
  ),
  "watchdog.peer_timeout_s": Key(
    30.0,
    real(0.0),
    keys.FREE,
    "A peer whose liveness counter (trainer/cluster/liveness.py, its own thread, whatever the phase) has "
    "not moved for this long is lost: stopped, dead or partitioned away; so is the link between two "
    "processes that both reach process 0 but whose direct probes (trainer/cluster/links.py, through each "
    "process's peer service on port PEER_PORT_BASE + process index) have failed for this long. Every "
    "process names what it lost and exits 3. Must stay below JAX's heartbeat timeout (100 s unless set), "
    "which aborts without a name. 0: off (no peer service either).",
    program=False,
  ),
  "checks.replica_every": Key(
    0,
    whole(0),
    keys.FREE,
    "Every N steps and before every checkpoint, compare checksums of every copy of each replicated array "
    "of the train state (trainer/checks/replicas.py); a device whose copy differs stops the run (exit 4)"
    " before it saves. 0: never. The "
    "local tier then resumes only from a copy of a checked step.",
    program=False,
  ),
  "checks.recompute_every": Key(
    0,
    whole(0),
    keys.FREE,
    "Every N steps and on every scheduled save, run the step a second time from a copy of its state and "
    "batch with each shard on another device of the same process, and compare bit for bit "
    "(trainer/checks/recompute.py): what catches a device computing wrong where nothing is replicated "
    "(pure FSDP). Costs one more step and a copy of the state on the checked steps. 0: never.",
    program=False,
  ),
  "checks.first_step": Key(
    True,
    boolean,
    keys.FREE,
    "At a run's first step, and after a restore under another layout (mesh, strategy, rules, "
    "microbatches, jax, XLA_FLAGS), run the real train step once more from the same state and batch "
    "under another layout of the same devices that compiles to another program and fits, and stop with "
    "exit 6 if their gradients or updates disagree: XLA partitioned the step wrongly "
    "(trainer/checks/first_step.py). Costs two compiles, a copy of the state and one more step. A "
    "train step that passed before on these devices is not checked again: checks.first_step_every_run.",
    program=False,
  ),
  "checks.first_step_every_run": Key(
    False,
    boolean,
    keys.FREE,
    "Run checks.first_step even for a program it passed before on these devices. By default a passed "
    "check is kept beside the compilation cache, and a new run of the very same compiled step (a new "
    "workdir of the same config, where the cache is shared) says when it passed instead of checking it "
    "again; a first step that is not finite is then the loop's NaN/Inf handling, not exit 7 "
    "(trainer/checks/checked_programs.py).",
    program=False,
  ),
  # A JAX profiler trace of steps start_step+1 .. start_step+steps on every process, in
  # WORKDIR/profile/process_I (TensorBoard's profile plugin, or Perfetto), read back into each
  # process's compute / collective / wait / idle split (processes/process_I.jsonl and a console table).
  "profile.start_step": Key(
    5,
    whole(0),
    keys.FREE,
    "The window begins after this step (of the run's own count: warm-up first).",
    program=False,
  ),
  "profile.steps": Key(0, whole(0), keys.FREE, "Steps traced; 0: no profile.", program=False),
  "straggler.factor": Key(
    3.0,
    real(0.0),
    keys.FREE,
    "One line names a process whose data wait or step dispatch time per step (over a logging window) "
    "exceeds the median of the other processes' by this factor, and by at least min_s. 0: never.",
    program=False,
  ),
  "straggler.min_s": Key(
    0.05, real(0.0), keys.FREE, "Seconds per step: smaller differences are noise.", program=False
  ),
}
