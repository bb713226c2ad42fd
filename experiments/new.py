"""Fork an experiment: copy a working one and its config under a new name.

  python -m experiments.new NAME --from=lm|vit [--config=configs/START.py]

writes experiments/NAME.py (a copy of experiments/FROM.py, or of the folder experiments/FROM/), its keys
experiments/NAME_keys.py (a copy of FROM's) and configs/NAME.py (a copy of FROM's smoke config, pointed
at NAME), then prints what to run next.
Nothing else changes: the trainer and the other experiments are left as they are.
"""

import argparse
import os
import re
import shutil
import sys

import exit_codes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The config each shipped experiment is forked with: its smoke config on 8 logical CPU devices.
START_CONFIGS = {"lm": "configs/smoke_cpu.py", "vit": "configs/vit_smoke_cpu.py"}
RESERVED = {"new", "base"}


def fork(name: str, source: str, config: str | None = None, repo: str = REPO) -> list[str]:
  """Copies experiment `source` and its config to `name`; returns the new paths (relative to repo)."""
  if not re.fullmatch(r"[a-z_][a-z0-9_]*", name) or name in RESERVED:
    raise ValueError(f"NAME={name!r}: use a lower-case Python identifier other than {sorted(RESERVED)}")
  exp_dir = os.path.join(repo, "experiments")
  module, folder = os.path.join(exp_dir, f"{source}.py"), os.path.join(exp_dir, source)
  if not (os.path.isfile(module) or os.path.isfile(os.path.join(folder, "__init__.py"))):
    raise ValueError(f"--from={source}: no experiments/{source}.py or experiments/{source}/")
  config = config or START_CONFIGS.get(source) or f"configs/{source}.py"
  if not os.path.isfile(os.path.join(repo, config)):
    raise ValueError(f"no start config {config} for --from={source}: pass --config=configs/START.py")
  new_config = f"configs/{name}.py"
  keys_file = os.path.join(exp_dir, f"{source}_keys.py")
  if not os.path.isfile(keys_file):
    raise ValueError(f"--from={source}: no experiments/{source}_keys.py (the experiment's keys)")
  own = f"experiments/{name}.py" if os.path.isfile(module) else f"experiments/{name}/"
  targets = [own, f"experiments/{name}_keys.py", new_config]
  for target in targets:
    if os.path.exists(os.path.join(repo, target)):
      raise ValueError(f"{target} exists already: choose another NAME")
  with open(os.path.join(repo, config)) as f:
    text = f.read()
  call = re.compile(rf"""base\.get_config\((["']){re.escape(source)}\1\)""")
  if not call.search(text):
    raise ValueError(f"{config} does not call base.get_config({source!r}): pass the config of {source}")
  text = call.sub(f'base.get_config("{name}")', text)
  text = text.replace(config, new_config)
  text = re.sub(r"--workdir=runs/\w+", f"--workdir=runs/{name}", text)
  # The docstring described the original and held its measured figures: a recipe to fill in instead.
  docstring = re.match(r'\A""".*?"""\n', text, re.S)
  if docstring is None:
    raise ValueError(f"{config} does not start with a docstring (its recipe): pass another config")
  text = _recipe(name, config, source) + text[docstring.end() :]
  if os.path.isfile(module):
    shutil.copyfile(module, os.path.join(repo, targets[0]))
  else:
    shutil.copytree(folder, os.path.join(repo, targets[0]), ignore=shutil.ignore_patterns("__pycache__"))
  with open(keys_file) as f:
    keys_text = f.read().replace(f"experiments/{source}.py", own)
  with open(os.path.join(repo, targets[1]), "w") as f:
    f.write(keys_text)
  with open(os.path.join(repo, new_config), "w") as f:
    f.write(text)
  return targets


def _recipe(name: str, config: str, source: str) -> str:
  """The new config's docstring: what the template's configs say, with nothing measured yet."""
  return f'''"""{name}: forked from {config} and experiments/{source}.py; say here what it trains.

Recipe:
  python main.py --config=configs/{name}.py --workdir=runs/{name} --cpu_devices=8
Hardware: (fill in: the devices and mesh it is meant for)
Expect: (fill in once measured: how long it takes, and the final loss or metric it reaches)
Arguments: `:tiny` shrinks it to a 2-step pulse; short arguments combine, e.g.
`--config=configs/{name}.py:tiny,fsdp=8` (see trainer/config/assemble.py).
"""
'''


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.new", description=__doc__.split("\n\n")[0])
  parser.add_argument("name", help="the new experiment's name, e.g. mine")
  parser.add_argument("--from", dest="source", required=True, help="the experiment to copy: lm, vit, ...")
  parser.add_argument("--config", help="the config to copy (default: the experiment's smoke config)")
  args = parser.parse_args(argv)
  try:
    paths = fork(args.name, args.source, args.config)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return exit_codes.USER_EXIT
  config = paths[-1]
  run = f".venv/bin/python main.py --cpu_devices=8 --config={config}"
  print(f"wrote {', '.join(paths)}. Next:")
  print(f"  {run}:tiny --workdir=runs/{args.name}_pulse                # 2 steps")
  print(f"  {run}:tiny --workdir=runs/{args.name}_verify --mode=verify # the objective")
  print(f"  {run} --workdir=runs/{args.name}")
  print("then change loss_sums, build_model or data_sources (docs/getting-started/first-fork.md).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
