"""Supervised fine-tuning and offline preference optimisation (DPO / IPO) of the decoder: data, steps, loop.

``launch/train_sft.py`` and ``launch/train_dpo.py`` drive these modules; the pure losses live in
`jaxrl_hf.algos.preference`.
"""
