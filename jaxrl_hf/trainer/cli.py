"""Main entry point: ``jaxrl-hf-train --algo dapo [--preset smoke[,dp2]] [key.path=value ...]`` (from a checkout:
``python launch/train.py ...``).

With nothing else, ``--algo dapo`` runs the embedded default: SmolLM2-135M-Instruct on synthetic arithmetic
prompts with a GSM8K validation subset, sized for a small CPU-only host (verl's DAPO recipe in configs/dapo.yaml, resized by
configs/laptop/dapo.yaml, over the defaults in jaxrl_hf/config/schema.py). ``--preset smoke`` runs any algorithm for 2 steps on a tiny random model.
Overrides use verl's dotted keys, e.g. ``actor.clip_ratio_high=0.28 trainer.total_steps=10``.
``--import FILE_OR_MODULE`` (repeatable) imports your own code first, in this process before the config is
validated and in every worker process: e.g. a file with one ``@register_adv_estimator("my_adv", needs=("index",))``
function makes ``algorithm.adv_estimator=my_adv`` valid (likewise ``@register_policy_loss`` for
``actor.policy_loss.loss_mode``, ``@register_kl_estimator`` for ``algorithm.kl_penalty``/``actor.kl_loss_type``).
Exit status (jaxrl_hf/errors.py, docs/RELIABILITY.md): 0 done, 1 a bug, 2 configuration, 3 dynamic sampling found
too few informative prompts, 4 data, 5 checkpoint, 6 worker (died, raised, or timed out), 7 non-finite numbers,
8 an exception in your own --import'ed code (the module and function named),
75 stopped by SIGTERM / Ctrl-C after a checkpoint (run the same command to resume), 130 a second Ctrl-C.
Errors print one line; the traceback goes to <trainer.run_dir>/error.log.
``--dry-run`` only checks and prints the resolved config (verl command lines included: their keys are renamed,
accepted with a reason, or refused together with the reason for each); it loads no data or model, starts nothing.
"""

from __future__ import annotations

import argparse

from jaxrl_hf.config.schema import ALGOS  # (the one list of --algo names)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (see the module docstring) and run; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=ALGOS, default="dapo")
    parser.add_argument("--preset", default=None, help="preset name(s) from configs/presets (comma-separated) or a .yaml path")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE_OR_MODULE",
                        help="a .py file or a dotted module name to import before the config is validated, in this "
                             "process and in every worker process (repeatable; added to the config key 'imports')")
    parser.add_argument("--dry-run", action="store_true",
                        help="only load, alias and validate the config (verl keys included) and print it with a report "
                             "of renamed and ignored keys; touches no data, model, device or Ray (exit 0 valid, 2 not)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. actor.clip_ratio_high=0.28")
    args = parser.parse_args(argv)
    if args.dry_run:
        from jaxrl_hf.config.dry_run import dry_run

        return dry_run(args.algo, args.preset, args.overrides, args.imports)
    from jaxrl_hf.trainer import run

    return run(args.algo, preset=args.preset, overrides=args.overrides, imports=args.imports)

