"""XLA's SPMD partitioner can compute a wrong gradient (tests/xla_repro_fork.py): verify FAILs on the
fork, checks.first_step refuses to start training it with exit 6, and on a model XLA gets right the
check passes, before the first step and after a restore onto another mesh. If an XLA upgrade fixes
the miscompile, the first test says so instead of the others passing quietly."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import smoke_cpu
from tests import xla_repro_fork
from tests.conftest import patch_experiment, tiny_config
from trainer.checks import checked_programs
from trainer.checks.first_step import Miscompiled, NonFiniteFirstStep
from trainer.cluster import failures
from trainer.modes.verify import verify
from trainer.train import train

# The check run whatever the session's compilation cache holds (trainer/checks/checked_programs.py).
CHECKED = {"checks.first_step": True, "checks.first_step_every_run": True}

xla_repro_fork.install()


def _fork_config():
  """tiny_config's sizes, with checks.first_step as a fork's config has it: the default."""
  c = tiny_config()
  c.unlock()
  c.experiment = "xla_repro"
  c.lock()
  c.sharding.strategy = "fsdp_tp"  # w1 (., tensor), w2 (fsdp, tensor), the batch over (data, fsdp).
  c.checks.first_step = smoke_cpu.get_config().checks.first_step
  c.checks.first_step_every_run = True  # Whatever the session's cache holds.
  return c


def test_xla_still_miscompiles_the_two_matrices_in_a_bare_program():
  """The reproduction without template code: 20 lines of jit and grad."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  x, w1, w2 = (jax.random.normal(k[i], s) for i, s in enumerate([(16, 8), (8, 16), (16, 8)]))
  loss = lambda w, x: jnp.sum((jnp.tanh(x @ w[0]) @ w[1]) ** 2)
  sh = lambda *spec: NamedSharding(mesh, P(*spec))
  shardings = (sh(None, "tensor"), sh("fsdp", "tensor"))
  grad = jax.jit(jax.grad(loss), in_shardings=(shardings, sh(("data", "fsdp"))), out_shardings=shardings)
  wrong, right = grad((w1, w2), x)[0], jax.grad(loss)((w1, w2), x)[0]
  error = float(jnp.linalg.norm(wrong - right) / jnp.linalg.norm(right))
  if error < 1e-4:
    pytest.fail(
      f"jax {jax.__version__} now partitions the two-matrix gradient correctly (relative error {error:.1e}): "
      "the miscompile is fixed; make tests/xla_repro_fork.py expect PASS, or find another reproduction"
    )


def test_verify_fails_on_the_miscompiled_fork(tmp_path):
  assert not verify(_fork_config(), str(tmp_path), steps=2)


def test_training_the_miscompiled_fork_refuses_to_start_with_its_own_exit_code(tmp_path):
  with pytest.raises(Miscompiled, match=r"first step on mesh .* differs .* w1 \(gradients\)") as e:
    train(_fork_config(), str(tmp_path))
  line, code = failures.error_line(e.value, str(tmp_path))
  assert code == failures.MISCOMPILED_EXIT == 6 and "another mesh or sharding.rules" in line
  assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_the_check_passes_where_xla_is_right_and_runs_again_after_a_restore_onto_another_mesh(
  tmp_path, capsys
):
  agree = "checks.first_step: the first step's gradients and updates agree"
  train(tiny_config(steps=2, **CHECKED), str(tmp_path))
  assert agree in capsys.readouterr().out
  same = tiny_config(steps=4, **CHECKED)
  train(same, str(tmp_path), stop_after=3)  # The same mesh: not checked again.
  assert agree not in capsys.readouterr().out
  other = tiny_config(steps=5, **CHECKED)
  other.mesh.data, other.mesh.fsdp, other.mesh.tensor = 1, 8, 1
  train(other, str(tmp_path), stop_after=4)
  assert agree in capsys.readouterr().out
  # Microbatches change the compiled step as a mesh does: checked again, with its scan.
  train(
    tiny_config(
      steps=5,
      microbatches=2,
      **{
        **CHECKED,
        "mesh.data": 1,
        "mesh.fsdp": 8,
        "mesh.tensor": 1,
      },
    ),
    str(tmp_path),
  )
  assert agree in capsys.readouterr().out


def test_a_program_that_passed_is_not_checked_again_until_it_changes(tmp_path, capsys, monkeypatch):
  """A new workdir of the same config (the same compiled step) says when its check passed instead of
  running it; checks.first_step_every_run runs it; another mesh (another program) is checked;
  a failing check keeps nothing."""
  monkeypatch.setattr(checked_programs, "folder", lambda: str(tmp_path / "checked"))
  agree = "checks.first_step: the first step's gradients and updates agree"
  config = lambda **kw: tiny_config(steps=2, **{"checks.first_step": True, **kw})
  train(config(), str(tmp_path / "a"))
  assert agree in capsys.readouterr().out
  train(config(), str(tmp_path / "b"))
  out = capsys.readouterr().out
  assert agree not in out and "this train step passed on these devices on " in out, out
  assert f"({tmp_path / 'a'}: gradients and updates agreed with mesh " in out, out
  train(config(**{"checks.first_step_every_run": True}), str(tmp_path / "c"))
  assert agree in capsys.readouterr().out
  train(config(**{"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1}), str(tmp_path / "d"))
  assert agree in capsys.readouterr().out
  assert len(os.listdir(tmp_path / "checked")) == 2
  fork = _fork_config()
  fork.checks.first_step_every_run = False
  with pytest.raises(Miscompiled):  # The miscompiled fork: refused, and nothing kept to skip it next time.
    train(fork, str(tmp_path / "e"))
  assert len(os.listdir(tmp_path / "checked")) == 2


def test_a_change_xla_prints_alike_is_checked_again_and_a_logging_change_is_not(
  tmp_path, capsys, monkeypatch
):
  """RoPE's frequencies are a large constant, printed {...}: the same fingerprint for another
  model.rope_base or model.rope_scaling, so the record is keyed by the config keys that can shape the
  step too; log_every cannot, and a run that changes only it is not checked again."""
  monkeypatch.setattr(checked_programs, "folder", lambda: str(tmp_path / "checked"))
  agree = "checks.first_step: the first step's gradients and updates agree"
  # Heads of 128: RoPE's 64 frequencies are a constant XLA prints as {...}.
  wide = {"model.embed_dim": 256, "model.num_heads": 2, "checks.first_step": True}
  config = lambda **kw: tiny_config(steps=2, **{**wide, **kw})
  for i, changed in enumerate(
    [
      {},
      {"model.rope_base": 500.0},
      {"model.rope_scaling": "llama3", "model.rope_llama3_original_max_len": 8},
    ]
  ):
    train(config(**changed), str(tmp_path / str(i)))
    assert agree in capsys.readouterr().out, changed
  train(config(log_every=1), str(tmp_path / "logged"))
  assert "this train step passed on these devices on " in capsys.readouterr().out
  assert len(os.listdir(tmp_path / "checked")) == 3


def test_another_layout_is_another_program_and_an_invalid_one_is_skipped(tmp_path, capsys):
  """The candidate dp over (8, 1, 1) compiles to the configured program: the check takes the next
  layout (it compares programs, not labels), beside the recompute check on every later step. A
  candidate the config cannot run (global_batch_size=12 over 8 data-parallel devices) is skipped, not
  an error about a mesh the user never asked for."""
  train(
    tiny_config(
      steps=2,
      **{
        **CHECKED,
        "mesh.data": 8,
        "mesh.fsdp": 1,
        "mesh.tensor": 1,
        "sharding.strategy": "dp",
        "checks.recompute_every": 1,  # The checked first step is another program: not recomputed.
      },
    ),
    str(tmp_path / "a"),
  )
  out = capsys.readouterr().out
  assert (
    "agree with mesh {'data': 1, 'fsdp': 8, 'expert': 1, 'context': 1, 'tensor': 1} (strategy fsdp)" in out
  ), out
  train(
    tiny_config(steps=1, global_batch_size=12, **CHECKED),
    str(tmp_path / "b"),
  )
  out = capsys.readouterr().out
  assert (
    "agree with mesh {'data': 1, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 2} (strategy fsdp_tp)" in out
  ), out


def test_without_another_program_the_start_says_the_check_could_not_run(tmp_path, capsys):
  c = tiny_config(
    steps=1,
    **{
      **CHECKED,
      "mesh.data": 1,
      "mesh.fsdp": 1,
      "mesh.tensor": 1,
    },
  )
  train(c, str(tmp_path), devices=jax.devices()[:1])
  out = capsys.readouterr().out
  assert "checks.first_step could not run: one device has no other layout" in out, out
  assert "agree" not in out


def test_a_non_finite_first_step_has_its_own_line_and_exit_code(tmp_path, monkeypatch):
  from experiments import lm

  loss_sums = lm.loss_sums
  patch_experiment(
    monkeypatch, lm, loss_sums=lambda *a, **k: (loss_sums(*a, **k)[0] * jnp.nan, *loss_sums(*a, **k)[1:])
  )
  monkeypatch.setattr(checked_programs, "folder", lambda: str(tmp_path / "checked"))
  with pytest.raises(NonFiniteFirstStep, match="not finite") as e:
    train(tiny_config(steps=2, **CHECKED), str(tmp_path))
  line, code = failures.error_line(e.value, str(tmp_path))
  assert code == failures.NONFINITE_FIRST_STEP_EXIT == 7 and "not a partitioning question" in line
  assert not (tmp_path / "checked").exists()  # Nothing compared: nothing kept.
