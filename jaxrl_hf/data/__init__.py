"""Datasets in verl's schema, prompt-length filtering, samplers and a resumable prompt loader."""

from jaxrl_hf.data.arithmetic import ArithmeticConfig, generate_arithmetic
from jaxrl_hf.data.calculator import generate_calculator
from jaxrl_hf.data.filtering import FilterReport, filter_by_prompt_length, prompt_token_ids
from jaxrl_hf.data.io import read_many, read_rows, write_rows
from jaxrl_hf.data.loader import PromptLoader, dataset_fingerprint
from jaxrl_hf.data.samplers import (CurriculumSampler, RandomSampler, Sampler, SequentialSampler,
                                    informative_priority, make_sampler)
from jaxrl_hf.data.schema import DataFileError, DatasetRowError, make_row, validate_row

__all__ = [
    "ArithmeticConfig", "CurriculumSampler", "DataFileError", "DatasetRowError", "FilterReport", "PromptLoader", "RandomSampler",
    "Sampler", "SequentialSampler", "dataset_fingerprint", "filter_by_prompt_length", "generate_arithmetic",
    "generate_calculator",
    "informative_priority", "make_row", "make_sampler", "prompt_token_ids", "read_many", "read_rows",
    "validate_row", "write_rows",
]
