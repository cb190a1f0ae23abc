"""The parts of ``benchmarks/gpu_check.py``, the one-GPU acceptance check, one concept each:

- :mod:`gpu.common`: constants, progress lines, guarded parts, the world-of-one process group,
  logged subprocesses;
- :mod:`gpu.profiles`: the sizes and time limits per device (CUDA: the real check; CPU: a smoke
  test);
- :mod:`gpu.equivalence`: part (a), each 3D-parallel layer and ``ParallelLlama`` against
  ``torch.nn`` and the reference Llama;
- :mod:`gpu.training`: part (b), the ``tetrad train`` runs (eager and ``--compile``) and their
  metrics;
- :mod:`gpu.memory`: part (c), the planner's predicted peak (``tetrad memory``) against the
  measured one, and the micro-batch choice it drives;
- :mod:`gpu.steptime`: part (d), ``tetrad calibrate``, the in-process compute measurement and
  the planner's predicted step time;
- :mod:`gpu.report`: part (e), the Markdown table and the list of problems.

The entry script ``benchmarks/gpu_check.py`` parses the options and runs the parts in order;
``benchmarks/gpu_memory.py`` reuses :mod:`gpu.common` and :mod:`gpu.memory`.
"""
