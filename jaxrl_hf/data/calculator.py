"""The ``calculator`` dataset: multi-digit arithmetic a small model gets wrong alone but a calculator tool
solves (data source ``calculator``; `jaxrl_hf.rewards.arithmetic.strict_score_details` scores it).

Problems are 4–6 digit products and sums (``48213 * 9271``), generated like ``arithmetic`` (seeded,
reproducible). The system prompt, which tells the model about the tool, is the caller's: the trainer passes the
``calculator`` tool's schema rendered by `jaxrl_hf.agent.chat.tools_system_prompt` (data sits below the agent
package and does not import it).
"""

from __future__ import annotations

from jaxrl_hf.data.arithmetic import ArithmeticConfig, generate_arithmetic

DATA_SOURCE = "calculator"
TOOL_INSTRUCTIONS = ("You are a careful assistant. Use the calculator tool for arithmetic, then end your reply "
                     "with the final answer as 'Answer: <number>'.")
PLAIN_INSTRUCTIONS = "You are a careful assistant. End your reply with the final answer as 'Answer: <number>'."
TEMPLATE = "Compute {expression}."
CALCULATOR_PROBLEMS = ArithmeticConfig(min_digits=4, max_digits=6, operators=("+", "*"), num_operands=2,
                                       template=TEMPLATE)
ONE_SHOT_EXAMPLE = (
    {"role": "user", "content": "Compute 1234 * 5678."},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}'
                                     '\n</tool_call>'},
    {"role": "tool", "content": "7006652"},
    {"role": "assistant", "content": "Answer: 7006652"},
)
"""One worked exchange (user -> tool call -> tool answer -> answer), put between the system prompt and the problem."""
MIN_PROMPT_TOKENS = 320
"""``data.max_prompt_length`` that fits these prompts with the tool schema (SmolLM2's template: ~250 tokens)."""


def generate_calculator(n: int, seed: int, *, system_prompt: str | None = None, split: str = "train",
                        config: ArithmeticConfig = CALCULATOR_PROBLEMS, one_shot: bool = False) -> list[dict]:
    """``n`` rows (``data_source='calculator'``), reproducible from ``seed``, with ``system_prompt`` (default:
    `PLAIN_INSTRUCTIONS`, no tool: the no-tool baseline) and, if ``one_shot``, `ONE_SHOT_EXAMPLE` after it
    (about 90 more tokens)."""
    rows = generate_arithmetic(n, seed, config, split=split, data_source=DATA_SOURCE,
                               system_prompt=system_prompt or PLAIN_INSTRUCTIONS)
    if one_shot:
        for row in rows:
            row["prompt"] = [row["prompt"][0], *(dict(m) for m in ONE_SHOT_EXAMPLE), *row["prompt"][1:]]
    return rows
