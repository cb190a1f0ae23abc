"""The parts of ``benchmarks/vs_transformers.py``, tetrad against transformers'
``LlamaForCausalLM``, one concept each:

- :mod:`vs_hf.llama`: the Hugging Face side (its config of tetrad's sizes, checked back; the
  model; its training step; how it calls SDPA);
- :mod:`vs_hf.rounds`: what both sides share (optimizer settings, batch shape), building a
  side's model and timing one round of it, and pooling the rounds;
- :mod:`vs_hf.report`: the Markdown table, the progress lines and the list of problems.

The entry script ``benchmarks/vs_transformers.py`` parses the options and runs the rounds.
"""
