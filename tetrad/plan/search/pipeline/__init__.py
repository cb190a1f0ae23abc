"""The pipeline axis of the 4D search: ``G_pipe x`` virtual stages ``x`` schedule on top of every
5D grid of ``GPUs / G_pipe`` ranks (:class:`~tetrad.plan.search.pipeline.pipe_search.PipeSearch`),
added to the 5D search's top-K.

Space (:mod:`~tetrad.plan.search.pipeline.configs`): ``G_pipe`` a divisor of the GPUs from 2 to
the blocks; the 5D grid of the rest as in :mod:`tetrad.plan.search.four_d` (model sharding,
context split, ``B % (G_data G_z) == 0``, both orientations); micro-batch ``b`` dividing ``B /
(G_data G_z)``, ``m`` micro-batches; checkpointing ``none``, ``selective`` or ``full`` on every
block (``selective`` only where ``none`` does not fit, ``full`` only where neither does);
schedules (:mod:`tetrad.plan.pipe.schedule`): ``1f1b`` where ``m >= G_pipe`` (GPipe has the same
bubble and more memory, so it is tried only where 1F1B cannot run) and ``interleaved-1f1b`` with
``v`` in :data:`~tetrad.plan.search.pipeline.configs.VIRTUAL_CHOICES` (``G_pipe v <= L``, ``m %
G_pipe == 0``). Memory: :func:`tetrad.plan.memory.pipeline.pipeline_memory` (worst rank, 80%);
time: :func:`tetrad.plan.pipe.pipeline_step.pipeline_estimate`.

Pruning, exact (no configuration that could enter the top-K is skipped):

1. per ``(G_context, G_y, G_x, mode)``: a rank does ``1/G_pipe`` of the model's blocks on
   ``B / (G_data G_z)`` samples, ``B G_context G_y G_x / GPUs`` samples' worth of whole-model
   work whatever ``G_pipe`` is; with every GEMM at the machine's best efficiency (attention and
   element-wise work are linear in the tokens) this is a lower bound of the step;
2. per group ``(G_pipe, G_context, G_y, G_x, b, mode)``: ``m`` times the slowest rank's time
   of one micro-batch (it runs them one after another whatever the schedule), that time at
   least the average (the whole model's over ``G_pipe``) and at least ``ceil(L / G_pipe)``
   blocks'; plus, for the average, the ranks' mean idle time before their first and after their
   last operation, and for the rank of the most blocks, the stages before it that micro-batch 0
   and the last one pass through on the way in and out (the least over the group's schedules;
   where only GPipe runs, ``sum_r T_r + (m - 1) max_r T_r``), visited in ascending order of
   ``m`` times the larger floor; then, cheapest first, with the blocks' context collectives (the
   least over ``G_z``), the group's memory floor, and the blocks' exposed X/Y collectives (the
   lesser orientation) added (:mod:`~tetrad.plan.search.pipeline.group_bounds`,
   :mod:`~tetrad.plan.search.pipeline.memory_floors`);
3. per grid: its memory floor; then ``m`` times a rank of ``ceil(L / G_pipe)`` blocks, their
   compute, X/Y and context collectives and the Z seconds its windows cannot hide (as
   :class:`tetrad.plan.search.step_bounds.StepBounds`) and the fewest point-to-point receives of
   a rank, plus the way in and out of the split's last rank of the most blocks
   (:mod:`~tetrad.plan.search.pipeline.schedule_floors`); then the schedule's memory floor; then
   ``m`` times that rank's time (shared with the estimate) plus the same way in and out; its
   memory (rank by rank, the first above the limit ends it); that floor plus a rank's tail (the
   optimizer and what the cool-down leaves exposed,
   :func:`tetrad.plan.pipe.pipeline_step.rank_tail`), that rank's first, then each's (the step
   adds the largest); then the estimate. Every floor of the path is at most the critical path
   of :func:`tetrad.plan.pipe.critical_path.schedule_step` (whose module doc gives the paths).

Shapes, groups, grids, schedules at bound 3 and schedules at their rank floor are entries of one
best-first queue (with the 5D search's, :meth:`tetrad.plan.search.four_d.Search4D.rank`), each
at least its parent's bound, visited in ascending bound until the next is not below the slowest
of the top-K so far; a shape's groups enter as a chain in descending micro-batch where bound 2
does not grow with it (a monotone GEMM table), one group at a time; memory floors reject
whatever the top-K.

Modules, each a class or functions with explicit inputs, memoised on its own:
:mod:`~tetrad.plan.search.pipeline.configs` (the space),
:mod:`~tetrad.plan.search.pipeline.floor_terms` (the floors' terms per shape),
:mod:`~tetrad.plan.search.pipeline.group_bounds` (bounds 1 and 2),
:mod:`~tetrad.plan.search.pipeline.memory_floors` (the memory floors),
:mod:`~tetrad.plan.search.pipeline.schedule_floors` (bound 3 and a schedule's rank floors),
:mod:`~tetrad.plan.search.pipeline.pipe_search` (the search that visits them best first and
times what is left).
"""
