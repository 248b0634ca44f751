"""Load verl's rule scorers (the reference the issue asks parity with) straight from their files.

verl is installed without its dependencies (``pip install --no-deps verl``); importing ``verl`` itself
would pull torch/tensordict/ray, so the three scorer files, which import only ``re``/``typing``, are
loaded by path. Returns None when verl is not installed.
"""

from __future__ import annotations

import importlib.util
import pathlib
import types


def load_verl_scorers() -> dict[str, types.ModuleType] | None:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = pathlib.Path(next(iter(spec.submodule_search_locations))) / "utils" / "reward_score"
    modules = {}
    for key, filename in (("gsm8k", "gsm8k.py"), ("math", "math_reward.py"), ("math_dapo", "math_dapo.py")):
        path = root / filename
        if not path.is_file():
            return None
        mod_spec = importlib.util.spec_from_file_location(f"_verl_ref_{key}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        modules[key] = module
    return modules
