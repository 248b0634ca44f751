"""``launch/train.py --dry-run``: load, alias, validate and print a config, touching no data, model, device or Ray.

`dry_run` prints the resolved config as YAML, then a report as YAML comments (so the whole output still reads as
YAML): the verl keys read under this schema's names, the keys accepted with no effect and why, and the paths
that do not exist on this host (not checked in a dry run, so a command line for a cluster can be checked on a
laptop). Exit status 0 when the config is valid, 2 (``ExitCode.CONFIG``) with every key problem listed when not.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

import yaml

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.loader import load_config_with_report
from jaxrl_hf.config.run_length import run_length_note
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.config.validate_paths import path_problems
from jaxrl_hf.config.verl_keys import KeyReport
from jaxrl_hf.errors import ExitCode


def report_lines(config: RunConfig, report: KeyReport) -> list[str]:
    """The dry run's report, one ``# ...`` line each: the run length, renamed keys, keys with no effect, missing
    paths, where the values came from."""
    lines = [f"# dry run: the config is valid (--algo {config.algo}); nothing was loaded or started",
             f"# run length: {run_length_note(config)}"]
    if report.renamed:
        lines.append(f"# {len(report.renamed)} verl key(s) read under this schema's names:")
        lines += [f"#   {key} -> {target}" for key, target in report.renamed]
    if report.ignored:
        lines.append(f"# {len(report.ignored)} key(s) accepted with no effect here (a run logs a warning for each):")
        lines += [f"#   {key}: {reason}" for key, reason in report.ignored]
    lines += source_lines(report)
    missing = path_problems(config)
    if missing:
        lines.append(f"# {len(missing)} path(s) not found on this host (not checked in a dry run; a run needs "
                     "them):")
        lines += [f"#   {key}={value}: {rule}" for key, value, rule in missing]
    return lines


def source_lines(report: KeyReport) -> list[str]:
    """``# key: source`` for every key a file or an override set (the rest are the schema's defaults); a key set
    more than once lists its sources in order, the last one's value standing."""
    if not report.sources:
        return []
    lines = ["# where the values came from (keys not listed: the schema's defaults, jaxrl_hf/config/schema*.py):"]
    return lines + [f"#   {key}: {' <- '.join(sources)}" for key, sources in report.sources.items()]


def dry_run(algo: str, preset: str | Sequence[str] | None = None, overrides: Iterable[str] = (),
            imports: Iterable[str] = (), out: TextIO | None = None) -> int:
    """Validate and print the config of ``launch/train.py --algo algo --preset preset overrides...``; returns the
    exit status (0 valid, 2 not: the errors go to stderr)."""
    out = out or sys.stdout
    try:
        config, report = load_config_with_report(algo, preset, list(overrides), list(imports), check_paths=False)
    except ConfigError as err:
        print(f"jaxrl_hf: config error: {err}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    out.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
    out.write("\n".join(report_lines(config, report)) + "\n")
    return int(ExitCode.OK)
