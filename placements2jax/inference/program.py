"""Whole-program selection: every equation's signature chosen for the whole program (pure).

Eager selection (torch's DTensor dispatch, op by op) gives each equation the best
signature for the layouts its inputs happen to have. A partial sum is then carried
through every op linear in it and reduced wherever a non-linear op needs it, possibly
several times (once per consumer) and on larger tensors, where reducing once, early, is
far cheaper. OneFlow's graph mode and Alpa's intra-operator pass instead choose the
layouts of the whole program; so does :func:`select_program`, on the dataflow graph the
jaxpr walker records (:class:`ProgramGraph`: one :class:`ProgramNode` per equation, with
the ranked candidates of its rule and where each input comes from).

**Objective**: the program's predicted communication. Every value costs the planner's
redistribution (:func:`.plan.plan_cost`, the same cost model) from its producer's layout
to each distinct layout its consumers need (consumers needing the same one share it: a
compiled program computes it once), and every output of the function what it still
owes: for an output with a fixed layout, the plan to that layout; for a free one, the
plan to the layout its caller takes it in, eager dispatch's (``predict(search="eager")``),
its partials reduced, or for one updating inputs of its shape elementwise (an optimizer's
parameter and moments) their layout (``select_program``'s ``callers``,
:func:`.jaxpr._updated_layouts`). A caller uses an output next to
the function's inputs, in the layout their splits propagate to: a replicated
parameter's gradient whole, to update the parameter, as XLA returns a free output (its
partials all-reduced, its splits those its inputs give it). When it owed only its
partials' reduce-scatters (half the all-reduce that caller needs), the search
reduce-scattered a replicated weight's gradient over ``dp`` inside the program and
returned it split there, or sliced the weight over ``tp`` for free and returned its
gradient split there, where XLA returns it Replicate (docs/inference.md, "A replicated
parameter's gradient left as a free output"). A free output may still keep another
layout where that is cheaper with its move paid. Costs compare as (cost, number of
collectives): among equally cheap programs, fewer collectives. The function's inputs
keep their layouts; literals and constants are Replicate. Moves are priced as the
mesh's backend compiles them (:func:`_backend_rules`, :mod:`.combine`'s rules, which
``check`` counts by): CPU XLA forms no reduce-scatter, it all-reduces the whole block
and slices it, so there a planned move is priced by its collectives
(:func:`.plan.plan_priced`) with each reduce-scatter at an all-reduce's bytes; and it
sends a ``bfloat16`` value's collectives in ``float32``
(:meth:`.combine.CombinerRules.widening`), so there a bfloat16 move costs twice its
planned bytes; and so are an output's owed move and eager dispatch's look-ahead
charge (GPU and TPU send bfloat16 as it is: priced by the planner's bytes there). Ties as
compiled are broken by the planner's prices: a row-parallel bfloat16 partial cast to
float32 costs as much reduced before the cast (sent in float32) as the float32 output owes,
and the search reduces it in the program, as a backend that does not widen would
(tests/test_inference_programs.py). A bfloat16 partial cast and sliced to 12 of its 16
columns is reduced after the slice (288 B per device as compiled) where it was reduced
before the cast (384 B compiled, 192 by the planner). Priced by the planner alone, a reduce-scatter and an
all-gather cost what the one all-reduce XLA sends costs, and the search reduce-scatters
Llama's residual stream and all-gathers it back, twice the bytes on CPU; priced as
compiled, it all-reduces once (Llama's loss: 0.78x XLA's bytes in 12 collectives where
XLA all-reduces, slices and all-gathers in 18). But the descents end in other basins:
on CPU both searches run, priced as compiled and by the planner alone, and the cheaper
as compiled is kept (the planner's result is 0.66x the other's bytes as compiled on
GPT-2's adamw step, 1.05x on Llama's); the first descends only from the walked start,
without seeds (on the training steps its eager start and seeds never gave the kept
result). The descent as compiled runs twice, without and with *pull moves*
(:meth:`_Search.pull_moves`: an input's redistribution removed at its producers, upstream,
then cascading; a cascade only goes downstream), and the cheaper result is kept (with
pull moves alone Llama's value_and_grad went 0.70 -> 0.81x XLA's bytes; with them
Equinox's loss 1.17 -> 0.85x). A last descent from each chain's result (the planner's result
in its place where that is cheaper), with that chain's own moves, the cheaper finished result
kept, adds *reducing cascades*
(:meth:`_Search.reducing_moves`): at an equation that makes or receives a partial, its
candidates reducing it there (or its own), every equation downstream re-chosen as eager
dispatch would if it charged the partials it continues too, so partials are reduced where
they meet a consumer instead of carried (kept on the value moves' terms below: Llama's
adamw step 1.19 -> 1.07x XLA's bytes, 125 -> 115 collectives), and *shared-input moves*
(:meth:`_Search.alternatives`' ``shared``): an equation takes the candidate cheapest for its
inputs with an input free where another consumer already needs it so (Llama's weight
gradients read the normed activation as the forward matmuls gathered it and stay partial
over ``dp``, instead of gathering it over ``dp`` and moving the parameter and both Adam
moments to the transposed split and back: its adamw step 0.96 -> 0.76x XLA's bytes, 98 ->
68 collectives; offered in every descent, Equinox's adamw step went 1.09 -> 1.20x), and
*reduced moves* (:meth:`_Search.reduced_moves`): an equation making a partial with all its
consumers taking it reduced to Replicate, one all-reduce, cascading with ties broken by the
fewest inputs moved (optax's cross-entropy after the masked lookup of the label: its
logsumexp summed where the logits are split on the vocabulary and its gradient kept there,
where the sums went to the sequence split and the gradient's chain with them: Flax NNX's
value_and_grad 44,720 -> 43,232 B, Equinox's adamw step 48,064 -> 43,712 B).
Reducing cascades offered in every descent would double the search's time;
once, they add 0.2-0.3 s CPU to a cold predict of
the training steps (the second search 0.5-0.6 s: GPT-2's adamw step 1.4 -> 2.2 s,
Llama's 1.0 -> 1.8 s in all). Both chains are finished (stop 25): the dearer chain's finish
can end cheaper than the cheaper one's (Llama's adamw step on an (8,) mesh: the pull chain's
result, dearer before its finish, finished to 160,615 B where the other ends at 183,463, 33
collectives after XLA's combiner where 48; the other 18 programs of
benchmarks/dump_predictions.py unchanged), for one more finish where the chains do not tie
(Llama's 2-layer adamw step: cold predict 2.81 -> 3.04 s CPU, medians of 3 alternated
processes at load 3-4.6; GPT-2's, whose chains tie, 2.68 -> 2.69 s). Only the cheaper had
been finished (stop 22: on the programs measured then the dearer chain's finish never gave
the kept result, and a finish is the dearest descent on large programs, its first offer of
reducing cascades at every equation: 1.2-1.6 s CPU on Llama's 8-layer adamw step, searched
whole then, whose cold predict finishing the cheaper alone took 27.2 / 21.4 / 19.3 -> 24.2 /
17.0 / 13.0 s, load 5-9; a program with repeated layers now searches its reduced graph, two
layers, :func:`_seeded`, and finishes the whole once). What the rest costs there, per descent
(CPU s, equations changed, from -> to MB as compiled, load 5.6): the planner's from the eager
and walked starts 0.66 / 0.46, its value moves from the result and from its start 0.36 /
0.64; without pull moves from the walked start 2.69 (2,051 changes, 4.80 -> 1.06 MB), values
from that result 0.39 (-> 0.97), values from the walked start 2.61 (-> 0.91); with pull
moves 3.03 (4.74 -> 0.78), 1.21 (-> 0.68, finished), 1.19 (-> 0.75); the finish 2.44 (->
0.62). The walked start as compiled is far from every result (4.8 MB where eager's is 2.5
and the planner's result 1.4-1.7), yet it is the start of the kept result: from the
planner's result, its walked start or the eager choice the compiled descents end dearer
(Llama's 2-layer step 0.21-0.29 MB where they reach 0.15); from the no-pull chain's result,
the pull moves' descent ends dearer on Equinox's adamw step (0.061 MB where 0.057); with
value moves from the walked start alone, Llama's value_and_grad (0.141 MB where 0.138), its
8-layer adamw step (0.629 where 0.618) and Equinox's adamw step (0.063) end dearer.
Which descent gives the kept result, and what each variant of this sequence predicts on
the 17 programs of benchmarks/dump_predictions.py, is measured in docs/inference.md ("Which
descent gives the kept result", stop 24): without any one of the 11 descents some of those
programs, or Llama's adamw step on an (8,) mesh with a batch of 8 (tests/test_autoplan.py),
gets dearer (without the planner's from the eager start, on those only through a tie: the
same bytes in one more collective on Flax NNX's value_and_grad; but the stateful ``@nnx.jit``
adamw step of tests/test_frameworks.py, not among them, then predicts 47,808 B where 44,768,
1.067x XLA's bytes where 0.999x, 24 collectives after XLA's combiner where 20: stop 25).
The kept
result never moves more than eager dispatch by the planner's prices (the prediction's
own): where it would, the planner's search result is kept.

**One mesh dim's partial pulled**: the kept result ends with one more descent
(:func:`_partly`; of the search's two finished chains, from the cheaper, once, as the
seeded search's one finish of the whole program does: run in both finishes, the search
alone of Llama's 3-layer adamw step reached a basin the seeded search does not), offering
pull moves at the equations whose input arrives partial on several mesh dims with one of
those partials reduced upstream (:func:`_one_reduced`), stepping past the free moves
instead of re-choosing through them (up to ``_PARTLY_DEPTH`` equations): a clip's
global norm, three of whose squared sums were computed on a free ``dp`` slice of
replicated gradients, sums them all replicated over ``dp`` (the stacked LM's step: a 4 B
all-reduce over ``dp`` less, 12 -> 11 collectives after XLA's combiner against its 9;
the float32 Llama scan 18 -> 17 against 11; docs/inference.md section 6, stop 28).

**Tie-break**: the descent without pull moves breaks its cascades' cost ties by the fewest
inputs moved (:meth:`_Search.tie_moved`): the Megatron MLP step of docs/benchmarks.md
1.18x -> XLA's bytes and all-reduces, Llama's adamw step 0.76 -> 0.68x in 53 collectives
instead of 68, Equinox's value_and_grad 1.01 -> 0.97x. (Broken so in both descents,
GPT-2's and Equinox's adamw steps ended dearer.) The two descents still share
:meth:`_Search.greedy`'s memo (it finds both tie-breaks' answers in one pass) and
:meth:`_Search.evaluate`'s (an evaluation whose cascade met no tie the two break apart
holds for both): kept apart, the descents with pull moves made 1.5x the new evaluations on
Llama's adamw step (a cold predict of GPT-2's took 2.33 -> 2.66 s CPU when the rule came).

**Overhead per collective**: every collective also costs the cost model's
``collective_overhead`` bytes in the objective (a latency, as in torch's latency +
bandwidth cost model; :class:`.cost.CostModel`, by default
:data:`.cost.DEFAULT_COLLECTIVE_OVERHEAD`: 8,192 B per all-gather and all-to-all, 192 per
all-reduce and reduce-scatter since stop 39; one figure or one per planned kind): a plan
with more collectives must save more bytes than that per extra collective. The search runs
at :data:`.cost.SEARCH_OVERHEAD` (192 B on every kind, where its schedule was tuned) and a
model charging otherwise continues from its result (:func:`_continued`). The planner
routes the search's moves with the same overhead (:func:`.plan.cached_plan`'s ``overhead``; the walk of
the chosen program reports those routes): a (32,) bias gradient partial over ``dp`` and
``tp`` is all-reduced per mesh axis, 2 collectives, rather than reduce-scattered,
all-reduced and all-gathered, 3 collectives for 32 B less as compiled. With it (192 B)
(value_and_grad / adamw step, collectives against XLA's operands): GPT-2 46 / 55 -> 42 / 43
against 51 / 58, Flax NNX 54 / 62 -> 45 / 48 and Equinox 64 / 60 -> 47 / 48 against 50 / 50
(Equinox's bytes 1.17 / 1.13 -> 1.02 / 1.09x XLA's), Llama 63 / 111 -> 56 / 105 against
65 / 96. The kept result still never sends more bytes than eager dispatch (by the planner's
prices and eager's own routes, the overhead left out): than the fewer of the walk's first
candidates and of eager dispatch's own choice (``predict(search="eager")``'s walk, ranked
charging a partial kept while a split is gathered, which the search's walk does not: from
the first equation where that differs the two walks part, and bounded by its own walk
alone the search kept a layer norm ``P,S(0)`` where eager reduce-scattered it, 4 B more);
where it would, the planner's search result, else the fewer bytes as walked.

**Collectives after XLA's combiner**: the objective charges every planned collective its
overhead, but XLA's combiner merges independent all-reduces of one kind in one computation
(:mod:`.combine`), so two choices equal by the objective can compile to different counts.
The descents' deltas are sums over values and cannot see a group (a whole program's
property); where finished results are compared, :meth:`_Search.grouped` charges the
overhead per collective after the combiner (:meth:`_Search.combined`: the choice's moves
through :func:`.combine.planned_collectives` and :func:`.combine.combine`, ~2 ms on
GPT-2's adamw step, ~2.9 before what no choice changes was found once per program,
:class:`.combine.Dataflow`; a choice's rows rebuilt where it differs from the last one grouped):
:func:`_continued` keeps the cheaper of its first descent and its common descent by it
(at 1,024 B per collective the stacked LM's step: both 33,360 in 15 planned, the
descent's 10 after the combiner where the search's 11, XLA's 9), and :func:`_descended`
takes a descent's result no dearer by the objective in fewer after the combiner. Under a
model off the search's own 192 B (the default among them), :func:`_continued` ends with :meth:`_Search.regrouped`: every
equation's moves, and their *keeping cascades* (:meth:`_Search.keeps`: an equation whose
changed inputs now arrive as it takes them keeps its candidate), that leave the objective
no dearer, applied while they lower :meth:`_Search.grouped` (optax.MultiSteps' backward
layer scan re-chosen to carry its activation gradient reduced: the same bytes, 10 -> 9
after the combiner, XLA's count). Without keeping cascades (stop 31: the moves at each
collective alone in its group and at its value's producer) no final prediction of
benchmarks/dump_predictions.py or of section 14's programs under the latency-bound model
changed, for ~6% of a cold predict; a model of 192 B on every kind does not run it. Its
common descent offers every pull move as a keeping cascade too (:func:`_common_descent`:
GPT-2's FSDP x TP step no longer gathers its LayerNorm scales again in the backward layer
scan, 300,340 -> 283,828 by the latency-bound objective).

**The polish** (:func:`_polished`, stop 60): the search's last descent, from its result at
the model's overhead, offers besides the plain moves every other candidate of each equation
where a value it makes or reads costs something, each re-chosen alone
(:meth:`_Search.every_candidate`), and its result is kept only where cheaper on
:func:`_descended`'s terms: from the result it is given, it can only lower the search's
objective. The descents before it move where inputs are redistributed or partials made
and cascade each move downstream as eager dispatch would; none re-chooses an equation
alone so that it makes what its consumer takes (a chunked cross-entropy's gradient
broadcast the softmax's denominator split as the forward pass left it, then moved the
product by an all-to-all: 928 -> 760 B, XLA's 736).

**Search** (exact minimization is an integer program, as Alpa solves it; benchmarks/exact_milp.py
states this objective so for HiGHS: too large whole, dearer pruned, and its cheaper optima
no better predictions, docs/inference.md section 8): steepest
descent over large-neighbourhood moves from two starts (:meth:`_Search.starts`): the
eager choice, and the program re-walked with the cascade's greedy choice, whose
look-ahead waives the charge of a partial some input already has. Eager dispatch
charges ``P + S(0)`` the reduction it still owes (issue 16: torch reduce-scatters ``P``),
right op by op but a start from which the descent ends in a worse basin on training
steps; the cheaper of the two results is kept. The descent then continues from it with
one more kind of move, *value moves* (:meth:`_Search.value_moves`): every consumer of a
partial value re-chosen at once to take it in one layout (reduced to Replicate: one
all-reduce shared by all; or a layout one of them already needs), then cascading or
not (the consumers alone: a bias gradient reading its activation gradient already
all-reduced over ``tp`` for the matmuls, then partial over ``dp`` only, as XLA does). A
single-equation move cannot get there: a weight gradient feeding the clip, both Adam
moments and the update is reduce-scattered for each consumer's own sake and the updated
parameter and moments are all-gathered back into their layouts at the end. That result
is kept only if it has fewer bytes and no more collectives (on the Llama adamw step:
0.81x the bytes and 163 collectives instead of 180; GPT-2's: 0.90x, 82 instead of 88).
The same descent with value moves from the first round is also run from that result's
start (another basin: 0.89x the bytes on GPT-2's adamw step, 1.19x on Llama's), kept on
the same terms (once when the first round moved nowhere: both would descend from the same
choice). The finishing descent's value moves also gather a split value near the
outputs to Replicate for all its consumers (a replicated embedding's gradient made split:
its update would run split and all-gather the parameter and both moments at the end). A
move re-chooses one
equation: one that makes, carries or receives a partial reduces it right there (into a
split, or to Replicate on those mesh dims, or, with partials on several mesh dims, those
of one mesh dim only: a weight gradient reduces ``tp`` where it is formed and keeps
``dp`` for one all-reduce); one whose inputs are redistributed takes the
candidate cheapest for its inputs (eager's look-ahead may have paid to avoid a partial,
e.g. gathering a batch-split activation rather than making a weight gradient partial over
the batch axis). The move then *cascades*: every equation downstream whose inputs change
is re-chosen as eager dispatch would, until the changes die out (the cheapest-input move
is also tried without cascading: its consumers redistribute, once per layout, e.g. one
all-reduce after a residual add of two partials instead of one per input). Each round
applies the move that lowers the exact total most (the cost of the values the changed
equations touch, before and after); it stops when no move lowers it (at most ``_MOVES``
rounds). Evaluations are lazy: a move's delta is kept until an applied move changes an
equation it depends on, and a stale delta is only recomputed when it comes first, so a
round costs little more than the moves near the last change. Its bookkeeping costs what
each evaluation touches, no more: a cascade looks each queued equation up once (the
equations looked at are those it queued; a *follower*, whose inputs not fixed all come from
one producer, is re-chosen as soon as that producer changes, without the heap:
:meth:`_Search.followers`), a delta sums its values before, then after only until that sum
reaches the one before (:data:`_NOT_LOWER`: a delta not below zero is never applied, and
~80% are not), and an applied move scans only the evaluations still fresh for those it makes
stale (the large cascades, depending on most equations, go stale at the first moves and
are scanned no more): on the Llama adamw step with 8 unrolled layers the cold search took
21.5-23.3 -> 19.5-20.2 s CPU, the same choices (alternated in one process, load ~4-6 on
2 cores; the cascades and their deltas, ~60% of it, grow with the program); the followers
stepped through and the deltas stopped early then took it (the search alone, caches cleared,
garbage collector off, main and this alternated in one process, load 2-7) 14.3-17.1 ->
12.4-12.7 s CPU, with 4 layers 4.2-4.7 -> 3.8-4.4 s, with 2 layers 1.23-1.54 -> 1.08-1.19 s
(GPT-2's 2-layer step: 1.52-1.69 -> 1.25-1.72 s), the same choices and the same 8,309
cascades looking at 166,235 equations on the 2-layer step (38,042 at 8 layers). The search keeps every
evaluation with the choices it read (of the equations its cascade looked at and their
producers, and of the neighbours of those it changed; and every equation's moves with the
choices they read; so are pull moves, :meth:`_Search.pull_moves`): the later descents (from
another start, with pull moves, the finishing one) reuse those they meet again (made anew:
6,045 of 14,417 evaluations on GPT-2's adamw step, 8,309 of 14,957 on Llama's, 38,042 of
66,073 with 8 unrolled layers; an evaluation whose cascade looked at more than an eighth
of the program is kept with every choice instead of those it read: their union, the
neighbours of its ~1,000 equations on the 8-layer step, took ~0.25 ms where the cascade
itself took ~0.65, and 7 of those reuses are lost there, 38,049 made anew; equations' moves
are also kept by the states they depend on, :meth:`_Search._alternatives`: with both, the
search alone on Llama's adamw step with 2, 4 and 8 unrolled layers took 0.91, 0.91 and 0.89
of its time before, paired medians of 4 rounds alternated in one process at load 8-11,
GPT-2's 2-layer step 1.03, unchanged; the same choices). Keeping each
move's cascade alone too (so that an evaluation whose delta's neighbours alone changed
reprices its changes without cascading) left 6,374 of the 2-layer step's 8,309 cascades,
mostly small ones, and saved no time: its own bookkeeping cost what it saved. Measured per
descent there, what is left is not repeated work: no descent starts where another with the
same moves did, a reused evaluation costs one look-up (~8 us; ~0.2 s of the 8-layer search
in all, two thirds of it in first offers), and two thirds of the time of those made anew
goes to cascades of 100 or more changes whose delta is >= 0 (the first offers' and those
after an applied move re-chose most of the program), which no cheap bound found excludes.
Every applied move lowers the total from its start, and the result is kept only if cheaper
than the eager choice, so it never moves more than eager dispatch.
(First-improvement in program order was tried: it commits to the first cheaper reduction
point it meets, e.g. all-gathering a row-parallel matmul's operands instead of
all-reducing after the residual add, and then cannot reach XLA's plan; so did it in
batches, and a first offer at some equations only, the others offered once no delta is
below zero, ended dearer on some of the dump's programs too: docs/inference.md, "Smaller
first offers". Each descent's first offer, at every equation, makes ~60% of the new
evaluations; offering almost nothing first (the first delta below zero applied at once)
saved 0.15x of a cold predict of Llama's 2-layer adamw step, with dearer predictions.)

Why not merge *followers* into their producers, as Alpa's intra-operator pass merges
simple operators so that its ILP decides once per chain? On Llama's 2-layer adamw step the
elementwise equations are 76% of those its cascades look at (126,432 of 166,235) and hold
half of its evaluations, but moves applied there are decisions the kept result is made of:
54 of its 247 applied moves are at elementwise equations (33 at adds: residual adds of two
partials taking them reduced; 10 at muls, 6 at selects, 5 at subs), and 116 at equations
whose inputs come from one producer and that take every layout it gives as it comes
(transposes, reshapes and broadcasts reducing a partial input there, where it is smaller
or already in the layout their consumers need). Folded into their producers, those moves
are lost; even the strict followers (such an equation with the same shape and dtype out
as in) hold 7% of its cascades and 28 of its applied moves. What is folded is the walk
through them: a cascade steps through a follower without the heap, and a delta stops
pricing as soon as it cannot lower the total (:meth:`_Search.delta`). Nor are they made
implicit (a follower choosing what :meth:`_Search.greedy` gives for its producer's choice
holding a marker resolved through its chain's head, so that a cascade writes nothing for a
chain and a delta prices its values per head choice): measured on the adamw step with 2 and
8 unrolled layers, followers are 55% of the equations cascades look at and 57% of their
changes, the values inside follower chains (every consumer a follower of the producer) 30%
and 31% of those the deltas price, and cascades and deltas 45% and 56% of the search
(sampled): free, the chains would save at most ~20% and ~25% of it, while every memo key
reading a follower's choice would need it resolved through its chain first.

Why not dynamic programming over the DAG (per value, a table of the cheapest cost of
producing it in each layout)? It is exact on trees, but a value with several consumers
(a residual stream: the attention output feeds the layer norm's mean, its centred value
twice and the next residual add) has its upstream cost counted once per path, so the
tables overprice reducing early: exactly the decision that matters here. Measured on the
transformer block it chose the eager answer or worse; the cascade finds XLA's plan. As a
start for the descents (stop 45, not landed: each candidate's cost to come is its inputs'
moves plus each producer's cheapest cost to come divided by its number of consumers, the
outputs' charges added; chosen back to front, each equation the candidate cheapest with
its consumers' choices; then :meth:`_Search.improve` with pull and value moves and
:func:`_finish`, in place of :func:`_choose`'s chains) it is no cheaper in time (the 19
programs of benchmarks/dump_predictions.py 46 s where 29, the table itself 0.6-2.6 s of
Python over ~35 candidates per equation) and its basins are dearer by the latency-bound
objective on 11 of them (GPT-2's 2x4 adamw step 80,688 -> 124,976, Llama's 165,936 ->
185,012 in 26 collectives where 16, the Megatron MLP step 3,018 -> 18,886), the same on
3 (the losses of GPT-2, NNX and Equinox) and cheaper on 5: the 4x2 Llama step 290,766 ->
158,228, the (8,) GPT-2 step 90,439 -> 75,719, the (8,) Llama step 309,678 -> 265,582,
Llama's 2x4 loss 49,130 -> 37,866 and Equinox's adamw step by 32 in one collective more.
Two-mesh-dim Megatron plans are where it loses; as one more start kept where cheaper it
would add its time and the descents from it to every search.

Loops are in the graph like any other code (the walker's ``choose``): a loop body's
equations read its constants from their producers, and a scan's sliced inputs and stacked
outputs are nodes with one candidate per layout their producer can give, so a move inside
a backward scan cascades through the stacked gradients to their consumers after the loop.
A stacked output's node is re-chosen looking ahead to those consumers (:meth:`_Search.greedy_pair`):
stacked as it comes, its move is made after the loop, the loop's length times the slice's
(counted once inside the body), and GPT-2's adamw step went 41,770 -> 56,938 B from 2 to 8
layers (XLA's 44,942 B at every depth); with it, 41,770 B at both. Priced by the planner
alone, a stack arriving partial keeps the split it arrives in, the look-ahead deciding its
partials only (GPT-2's step on a 4x2 mesh: 110,314 -> 48,138 B, :meth:`_Search._greedy_stack`).
A loop's carries are its node's to choose: one candidate per carry option (the walk's
fixed point first, then the layouts the body returns, the carries reduced, the initial
ones, and per carry the layouts its producer can give), needing the initial values and
the body's results in those layouts and giving them to the loop's results and to the
body's reads of the carry (one value per body, so its consumers share its
redistributions: one all-reduce of a partial residual stream per layer, not one per
layer-norm consumer). The body's reads come before the node in program order (a back
edge); the cascade follows it once (``seen``). ``seeds`` (the walker's all-carries
options) are also tried from the best choice found: a descent from the eager choice
seldom re-chooses a carry first (on GPT-2's adamw step the forward scan's carry reduced,
0.70x the bytes). The walker re-solves further (:mod:`.jaxpr`): when the chosen body
returns a carry in a layout that was no option, it walks and searches again from there;
when the choice splits a carry over a mesh dim its initial value is not split over (a
gradient accumulator sharded over dp), from every loop's carries replicated over it (no
descent leaves the sharded basin: the stacked LM's accumulated adamw step 4.25 -> 1.00x
XLA's bytes, docs/inference.md section 6).

**Layer blocks** (:mod:`.blocks`): a program whose layers are unrolled repeats its
equations, and the descents above grow worse than linearly with them, in quality and time
(Llama's adamw step, Megatron dp=2 x tp=4: the objective 265,396 / 618,228 / 1,241,684 at
4 / 8 / 16 layers, 0.75x XLA's bytes in 168 collectives where XLA compiles 156 at 8; the
selection 2.4 / 7.6 / 51 s CPU). When :func:`.blocks.layer_blocks` finds layers (at least
3 copies covering half the program: on the programs of the tests' dump it finds none, and
their predictions are unchanged), :func:`_seeded` searches the graph with each block's
middle copies removed (as a two-layer model: :func:`.blocks.reduce`) by this same
selection, tiles its choice over the middle copies (from the first or the last copy, the
cheaper), copies whole copies onto others while that lowers the total, sweep after sweep
until one changes nothing (:func:`.blocks.copy_moves`: 265,396 -> 258,580 at 4 layers, all
in the first sweep at 3 to 16 layers), then finishes on the whole
graph with the moves at the blocks' seams offered first (:func:`.blocks.boundaries`),
bounded as every result is. The objective is then linear in the layers (57,600 more per
layer from 3 to 16: 200,980 / 258,580 / 488,980 / 949,780 at 3 / 4 / 8 / 16 layers; 0.60x
XLA's bytes in 70 collectives at 8, 0.59x in 126 at 16), and a cold predict takes 1.5 /
2.7 / 2.9 s CPU at 4 / 8 / 16 layers where the search alone took 3.1 / 8.5 / 43.9 s
(alternated, load 6-9): the selection 1.3 / 1.6 / 2.2 s, most of it the reduced graph's
search (~0.9 s, about the 2-layer step's); detection 26 / 44 / 87 ms, the finish 0.05-0.3 s.

Deterministic: candidates are scanned in their rule's ranking order
(:meth:`.signature.Candidate.rank_key`), equations in program order, and ties keep the
earlier one. Bounded: a move costs, per re-chosen equation, one (cached) plan look-up per
input and distinct layout its candidates need it in, and those are kept per kind of
equation (candidates and shapes: a model's repeated layers share theirs) and arriving
layouts; the choice is cached per walked program (its equations' signatures, sources and
inputs).
"""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
import math
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from operator import itemgetter, ne
from typing import Any

import numpy as np

from ..caches import cached
from ..layout import Layout
from ..mesh import DeviceMesh
from . import blocks
from .combine import (
    BACKENDS, CombinedCollective, CombinerRules, Dataflow, MovedEquation, PlannedCollective, combine, combiner_rules,
    move_computations, planned_collectives,
)
from .cost import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COMMUNICATING, REDUCE_SCATTER, SEARCH_OVERHEAD, UNMERGED_OVERHEAD,
    CostModel, Overhead, overhead_of,
)
from .plan import cached_plan, layout_state, plan_priced
from .regions import Region
from .select import pending_reduction
from .signature import Aval, Candidate, RedistributePlan, Signature, TensorSpec

__all__ = ["ProgramGraph", "ProgramNode", "ValueId", "forced_signature", "select_program"]

ValueId = tuple[str, int]  # (equation path, output index); ("in", i): the function's input i
_MOVES = 256  # moves applied at most


@dataclass(frozen=True, init=False)
class ProgramNode:
    """One equation of the walked program: its path, its inputs as the walk saw them,
    where each input comes from (None: a literal or constant, fixed as given) and the
    candidates of its rule, best-ranked for those inputs first (the eager choice).
    ``stacks``: the node stacks a loop body's value into the loop's output (a scan's
    ``ys``), re-chosen looking ahead to its consumers (:meth:`_Search.greedy_pair`).
    ``region``: a ``shard_map`` region's own collectives (:mod:`.regions`), which the
    search's count of collectives after XLA's combiner includes, as check's does."""

    path: str
    inputs: tuple[TensorSpec, ...]
    sources: tuple[ValueId | None, ...]
    candidates: tuple[Candidate, ...]
    stacks: bool = False
    region: Region | None = None

    def __init__(
        self, path: str, inputs: tuple[TensorSpec, ...], sources: tuple[ValueId | None, ...],
        candidates: tuple[Candidate, ...], stacks: bool = False, region: Region | None = None,
    ) -> None:
        # one dict update, not a frozen __setattr__ per field (every walk makes a node per equation)
        self.__dict__.update(path=path, inputs=inputs, sources=sources, candidates=candidates, stacks=stacks,
                             region=region)


@dataclass(frozen=True)
class ProgramGraph:
    """The dataflow of a walked program: equations in program order, the value each
    output of the function is (None: a literal or constant), the function's inputs, and
    its loops' (path, primitive) (``scan``, ``while``, ``cond``: the computations XLA's
    combiner groups within, :func:`.combine.planned_collectives`; not a scan of one trip,
    which XLA inlines)."""

    mesh: DeviceMesh
    nodes: Sequence[ProgramNode]
    outputs: tuple[ValueId | None, ...]
    inputs: tuple[TensorSpec, ...]
    loops: tuple[tuple[str, str], ...] = ()
    inlined: tuple[tuple[str, int], ...] = ()  # the scans of one trip: (path, position of the body's first node)
    # (a result of a scan of one trip, the value it is in the body): the combiner's dependencies follow the body
    returned: tuple[tuple[ValueId, ValueId | None], ...] = ()
    # (a cond's output, the values its branches return for it): what it is made from, though the cond's node reads
    # its index alone (the branches' equations are nodes of their own, their results read by the join's nodes)
    joins: tuple[tuple[ValueId, tuple[ValueId, ...]], ...] = ()
    # per scan XLA compiles as a loop, what its body returns (its carries', then its stacks'), each as (the row
    # moving it back to its carry or stacking it, the value it is in the body): the roots of XLA's post order of
    # the body (:func:`.combine.planned_collectives`)
    results: tuple[tuple[str, tuple[tuple[str, ValueId | None], ...]], ...] = ()


def forced_signature(op: str, inputs: tuple[TensorSpec, ...], candidate: Candidate, cost_model: CostModel) -> Signature:
    """The signature running ``candidate`` on ``inputs``: its plans from the inputs' layouts,
    routed as the program search prices them (the model's ``collective_overhead`` per collective)."""
    plans = tuple(
        cached_plan(s.shape, s.dtype, s.layout, x, cost_model, cost_model.collective_overhead)
        for s, x in zip(inputs, candidate.in_layouts)
    )
    # built directly, its pending reduction 0: dataclasses.replace was half of each call (~14% of a walk)
    forced = Candidate(
        candidate.in_layouts, candidate.out_layouts, plans, candidate.one_d, candidate.nest_order, candidate.out_avals,
    )
    return Signature(op, inputs, (forced,))


def select_program(
    graph: ProgramGraph, cost_model: CostModel, out_layouts: Sequence[Layout | None] | None = None,
    seeds: Sequence[tuple[str, int]] = (), dispatched: ProgramGraph | None = None,
    callers: Sequence[Layout | None] | None = None, rival: Sequence[Chosen] = (),
) -> dict[str, Candidate] | None:
    """The candidate of every equation (by path) minimizing the program's communication
    (module docstring); empty when the eager choice (each node's first candidate) is as
    cheap. ``out_layouts``: a layout (or None, free) per output of the function.
    ``seeds``: (path, candidate) moves also tried from the best choice found, each then
    descended again (a loop's other carry layouts, see the module docstring).
    ``dispatched``: the program as eager dispatch walks it (``predict(search="eager")``),
    the bound of the kept result's bytes; None: ``graph``'s first candidates.
    ``callers``: per free output, the layout its caller takes it in, what the objective
    charges it the move to (module docstring; None: its layout in ``graph``'s first
    candidates, its partials reduced).
    ``rival``: another search's choice of the same program (every equation's, as its
    candidate's layouts); where ``graph`` holds it, the search is abandoned (None) when
    its descents (:func:`_choose`) end dearer than it by the objective, before its
    finishing descents: :func:`.jaxpr._replicas_restart`'s restarts were kept where their
    descents ended at 0.46-0.91x the first search's objective and not where at 1.13-1.20x
    (stop 48: the 4x2 Llama adamw step's, 2.4 s of its 4.2 s cold predict)."""
    targets = tuple(out_layouts) if out_layouts is not None else (None,) * len(graph.outputs)
    given = None if callers is None else tuple(callers)
    rival_choice = _choice_of(graph, {path: (ins, outs) for path, ins, outs in rival}) if rival else None
    return _select(_Keyed(graph), cost_model, targets, tuple(seeds), _dispatched_choice(graph, dispatched), given,
                   rival_choice)


def _callers(graph: ProgramGraph, targets: tuple[Layout | None, ...]) -> tuple[Layout | None, ...]:
    """Per free output made by an equation, its layout in ``graph``'s first candidates (the
    walk's eager choice), its partials reduced; None for the others."""
    firsts = {node.path: node.candidates[0].out_layouts for node in graph.nodes}
    return tuple(
        None if target is not None or src is None or src[0] == "in" else firsts[src[0]][src[1]].without_partial()
        for src, target in zip(graph.outputs, targets)
    )


def _dispatched_choice(graph: ProgramGraph, dispatched: ProgramGraph | None) -> tuple[int, ...] | None:
    """Eager dispatch's choice in ``graph``: each node's candidate with the layouts of the
    first (eager's) candidate of ``dispatched``'s node at its path; None when some is not
    found. Not ``graph``'s first candidates: the search's walk ranks them without charging
    a partial kept while a split is gathered (:func:`.select.signature_for`), so after the
    first equation where that differs its choices are not eager dispatch's (a layer norm
    kept ``P,S(0)`` where eager reduce-scattered it, 4 B more)."""
    if dispatched is None or len(dispatched.nodes) != len(graph.nodes):
        return None
    return _choice_of(graph, {
        node.path: (node.candidates[0].in_layouts, node.candidates[0].out_layouts)
        for node in dispatched.nodes if node.candidates
    })


# an equation's chosen candidate as its layouts: (path, input layouts, output layouts)
Chosen = tuple[str, tuple[Layout, ...], tuple[Layout, ...]]


def _choice_of(
    graph: ProgramGraph, layouts: Mapping[str, tuple[tuple[Layout, ...], tuple[Layout, ...]]]
) -> tuple[int, ...] | None:
    """Per node of ``graph``, the index of its candidate with the (input, output) layouts
    ``layouts`` gives its path; None when some node is not given or has no such candidate."""
    found = []
    for node in graph.nodes:
        wanted = layouts.get(node.path)
        k = None if wanted is None else next(
            (k for k, c in enumerate(node.candidates) if (c.in_layouts, c.out_layouts) == wanted), None
        )
        if k is None:
            return None
        found.append(k)
    return tuple(found)


class _Keyed:
    """A graph as a cache key: its nodes' paths, sources and candidate tuples (by
    identity: the per-equation signatures are cached, so an unchanged program gives the
    same objects; the key holds the graph, so those objects outlive the entry)."""

    __slots__ = ("graph", "key")

    def __init__(self, graph: ProgramGraph) -> None:
        self.graph = graph
        nodes = tuple((n.path, n.sources, id(n.candidates), n.stacks) for n in graph.nodes)
        self.key = (graph.mesh, nodes, graph.outputs, graph.inputs)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keyed) and self.key == other.key


@cached(maxsize=256)
def _select(
    keyed: _Keyed, cost_model: CostModel, targets: tuple[Layout | None, ...], seeds: tuple[tuple[str, int], ...],
    dispatched_choice: tuple[int, ...] | None, callers: tuple[Layout | None, ...] | None,
    rival_choice: tuple[int, ...] | None = None,
) -> dict[str, Candidate] | None:
    graph = keyed.graph
    search = _Search(graph, cost_model, targets, callers, overhead=SEARCH_OVERHEAD)
    chosen, unfinished = _choose(graph, cost_model, targets, callers, seeds, dispatched_choice, search=search)
    if rival_choice is not None and search.total(chosen) > search.total(dict(zip(search.paths, rival_choice))):
        return None  # abandoned (select_program's rival)
    eagers = _eagers(graph, dispatched_choice)
    chosen = _commoned(search, eagers, _escaped(search, eagers, chosen, unfinished))
    model = search
    if cost_model.collective_overhead != SEARCH_OVERHEAD:
        # from the search's final result: from its raw choice the 8-device GPT-2 adamw step ended at 71,911 B in 11
        # collectives after the combiner where the 192 B search's result is 60,935 in 10 (now 64,519 in 10)
        chosen = _continued(search, cost_model.collective_overhead, eagers, chosen)
        model = search.repriced(compiled=True, overhead=cost_model.collective_overhead)
    chosen = _polished(model, eagers, chosen)
    return _chosen(graph, {node.path: 0 for node in graph.nodes}, chosen)


# the overhead per all-gather and all-to-all of :func:`_escaped`'s descent: the latency-bound model's
_ESCAPE_OVERHEAD = {ALL_GATHER: UNMERGED_OVERHEAD, ALL_TO_ALL: UNMERGED_OVERHEAD}


def _escaped(
    search: _Search, eagers: tuple[Choice, Choice], chosen: Choice, unfinished: Sequence[Choice]
) -> Choice:
    """``chosen`` or, where cheaper by the objective (:func:`_descended`), its descent with
    all-gathers and all-to-alls charged :data:`_ESCAPE_OVERHEAD` each, then descended
    again at the default overhead from there (offered first the equations the first
    changed). The default's descents stop in basins a split follows from one cheap
    reduce-scatter: the reduction of a tp-split feature dim scattered over the
    sequence, then every activation gradient after it sequence-split and gathered back
    for the weights' gradients (a median / quantile normalization's adamw step: 84,916 B
    in 20 collectives where XLA compiles 68,188 in 8); priced dear, those gathers leave
    that basin at once (71,188 B in 14). On benchmarks/dump_predictions.py's programs it
    lowers 6 of 19 lines in both bytes and collectives after the combiner (the 4x2
    Llama adamw step 219,716 -> 172,356 B, 53 -> 40 collectives; the 2x4 one 133,098 ->
    127,462, 29 -> 25; the 8-device GPT-2 step 65,191 -> 61,159, 19 -> 11), every output
    layout as it was, and leaves the others as they were; it costs ~6% of a cold predict
    of Llama's or GPT-2's step, ~15% of the Megatron MLP's (its two searches). Stop 41's
    ablation (main e23a9fc): removed, it changes one of those 19 lines (the 4x2 Llama
    step +32 B, 28 -> 30 collectives): the later descents of :func:`_continued` reach the
    others' results now; with :func:`_commoned` removed too, ~8% of the 2x4 Llama step's
    evaluations.

    Also from ``unfinished``, the compiled descents whose chain the planner's result took
    over (:func:`_choose`: it is cheaper there, its basin another), each result kept on
    the same terms against the best so far. Llama's 2-layer adamw step with FSDP x TP
    (tests/models/steps.py ``fully_sharded``): both chains took the planner's result
    (203,476 by the objective where the descents end at 246,084 and 237,892), whose
    basin moves the residual stream between the batch and the model dim over dp in
    every layer; finished (180,404) and escaped from there, it stays (173,108; 605,108
    at 8,192 B per all-gather and all-to-all). From the descent without pull moves the
    escape's first move re-chooses the first norm's scale multiply to take the
    activation split over dp as FSDP splits the scale, cascading through 101 equations
    (dp a second tensor-parallel axis): +4,224 B at the search's overhead, so no descent
    at it applies it, -75,776 at the escape's; the 15 moves after it lower both, to
    156,980 (229,556 at 8,192). The prediction went 155,572 B in 69 collectives after
    XLA's combiner to 120,180 in 43 (XLA's 268,120 in 90; 520,820 -> 200,436 by the
    default model, below the 1- and 3-layer trend's ~240,700), its cold predict 3.9 ->
    7.2 s CPU (:meth:`_Search.regrouped` 0.18 -> 2.45 s: 47 -> 43 collectives). The
    other starts run only where the planner's result took a chain over: none on Llama's
    2x4 adamw step, both on GPT-2's (this function 0.08 -> 0.19 s CPU, the same result).
    On benchmarks/dump_predictions.py's 19 programs GPT-2's 2x4 value_and_grad went 15
    -> 14 collectives after the combiner (the same 45,600 B) and its 4x2 adamw step to
    another choice as cheap by every figure; on section 14's the DPO step 161,598 ->
    161,214 B, DeepSeek-V2's 61 -> 58 planned collectives (the same 9 after the
    combiner), the two bfloat16 Llama scans to another choice as cheap as compiled (90,186
    B, 10 after the combiner, the objective 92,112) but 53,386 -> 63,626 B by the
    planner's prices, which CPU XLA does not send (its reduce-scatters are all-reduces)."""
    overhead = tuple(_ESCAPE_OVERHEAD.get(kind, overhead_of(search.overhead, kind)) for kind in COMMUNICATING)
    escape = search.repriced(compiled=True, overhead=overhead)  # type: ignore[arg-type]
    planned = search.planned()
    kept = chosen
    for start in (chosen, *unfinished):
        offered = _repriced_paths(search, escape, start)
        if not offered:  # no all-gather or all-to-all: a descent from a default optimum would not move
            continue
        away = escape.improve(start, values=True, reducing=True, pulls=True, offered=offered)
        if away == start:
            continue
        moved = [path for path in search.paths if away[path] != start[path]]
        found = search.improve(away, values=True, reducing=True, pulls=True, offered=moved)
        kept = _bounded(planned, eagers, _descended(search, kept, found), kept)
    return kept


def _commoned(search: _Search, eagers: tuple[Choice, Choice], chosen: Choice) -> Choice:
    """``chosen`` or, where cheaper by the objective (:func:`_descended`), its descent with
    common value moves (:meth:`_Search.value_moves`' ``common``: every consumer of a value
    moved at once into a layout each of them can take) and keeping cascades
    (:meth:`_Search.keeps`), the last descent of the latency-bound model's search
    (:func:`_continued`), here at the default overhead. The default's descents move a
    value's consumers one by one, or all into a layout some consumer already needs; a
    layout none of them needs yet, and a producer re-chosen without re-choosing its
    consumers, they do not reach. On section 14's programs (docs/benchmarks.md) it lowers
    5 of 17 in bytes and collectives after XLA's combiner: the Gemma-2 class step 209,286
    -> 204,870 B, 18 -> 14 collectives (XLA's 14), the sort-dispatched MoE step 125,366
    -> 90,890 B, 48 -> 33, the ragged one 17,686 -> 17,542, 13 -> 11 (XLA's 12), the bf16
    Llama scans 70,790 -> 67,718, 18 -> 17; on benchmarks/dump_predictions.py's 19 programs 7
    lower in both (Llama's 2x4 value_and_grad 124,640 -> 118,400 B, 26 -> 23; its adamw
    step 127,462 -> 124,390, 25 -> 24; the 8-device Llama step 159,719 -> 152,551, 32 -> 31),
    one trades bytes for collectives: the 4x2 Llama step 172,356 -> 186,628 B, 40 -> 38
    (its first search now ends below the share of data-parallel gathers that triggers
    :func:`.jaxpr._replicas_restart`, whose result it was). It costs ~0.27 s of a cold
    predict of Llama's 2x4 adamw step, 1,260 -> 1,532 ms idle (docs/benchmarks.md section
    7; ~560 common value moves evaluated, cascading; ~260 on GPT-2's). ``chosen`` as it is
    on a program with repeated layers (:attr:`_Search.layers`: the seeded search,
    :func:`_seeded`): there it changed no prediction measured and its cascades grow with
    the program (Llama's 8-layer adamw step 2.3 -> 3.5 s CPU, the same prediction; the
    4-layer step of the dump the same bytes and collectives). Stop 41's ablation (main
    e23a9fc): removed, it changes one of the dump's 19 lines (the 4x2 Llama step -954 B,
    one collective more): :func:`_continued`'s common descent reaches the others now."""
    if not search.walks_whole:
        return chosen
    found = _common_descent(search, chosen)
    planned = search.planned()
    return _bounded(planned, eagers, _descended(search, chosen, found))


def _common_descent(search: _Search, choice: Choice, latency: bool = False) -> Choice:
    """A descent from ``choice`` with common value moves and keeping cascades too
    (:func:`_commoned`); ``latency`` (only :func:`_continued`'s, at the model's overhead):
    with strict common value moves (:func:`_taken_as_made`) and keeping pull moves too.
    Strict moves in :func:`_commoned`'s, at 192 B per collective, took Flax Linen's scanned
    adamw step of tests/test_frameworks.py to a dearer basin, 41,774 -> 52,014 by the
    default's objective, 12 -> 13 collectives after XLA's combiner, and failed the dropless
    MoE step's test of tests/test_inference_programs.py. A keeping pull (stop 45) re-chooses
    the producers of an input moved in its consumer's layout, upstream (:meth:`_Search.pull_moves`),
    and keeps every consumer its inputs then reach as it takes them (:meth:`_Search.keeps`):
    GPT-2's FSDP x TP step (layers under ``lax.scan``, parameters split over ``dp``) gathered
    each layer's two LayerNorm scales over ``dp`` in the forward scan and again in the backward
    one, which read them as the forward stacked them, split. Pulled from the backward mul, the
    forward body gathers the scale's slice before its broadcast (where its mul gathered the
    broadcast: still one collective) and stacks it gathered; the plain pull's cascade then
    re-chose the backward mul as eager dispatch would, and the backward body, its loop and
    what follows it after it (69 equations), dearer. Kept: 300,340 -> 283,828 by the
    latency-bound objective, 59,892 B in 44 collectives after XLA's combiner -> 59,764 in 42
    (check's bytes; XLA's 61,285 in 62). The same descent lowers two more programs of section
    14 (docs/benchmarks.md): the Gemma-2 class step 204,880 -> 204,688 B (14 collectives),
    DPO on Llama 161,598 -> 161,294 B, 28 -> 25 collectives (286,974 -> 270,094); the dump's
    19 and section 14's other 28 unchanged. Also in :func:`_commoned`'s, the dump's 4x2 Llama
    step went 192,740 B in 28 collectives -> 182,020 in 40 (334,116 -> 413,700)."""
    return search.improve(
        choice, values=True, common=True, keeping=True, taken=latency, keeping_pulls=latency
    )


def _continued(search: _Search, overhead: Overhead, eagers: tuple[Choice, Choice], chosen: Choice) -> Choice:
    """Under a model whose overhead per collective is not :data:`.cost.SEARCH_OVERHEAD` on
    every kind (the default's among them): the search's choice at that overhead
    (``search``, ``chosen``) descended at the model's ``overhead``, offered first the
    equations that overhead prices otherwise (:func:`_repriced_paths`) and with one mesh
    dim's partial pulled (:func:`_partly`), then descended with value moves into a layout
    every consumer of the value can take (:meth:`_Search.value_moves`' ``common``) and
    keeping cascades (:meth:`_Search.keeps`), then regrouped (:meth:`_Search.regrouped`:
    moves no dearer by the objective while they lower the collectives after the combiner),
    bounded as every result is (:func:`_bounded`; ``chosen`` where cheaper). The descents' schedule was measured and
    tuned at 192 B: at 4,096 B per all-gather and all-to-all the stacked LM's adamw step
    searched from the start ended at 40,976 by that objective (in 12 collectives after
    XLA's combiner, one more than at 192), the descent from the 192 B choice at 31,632
    (24,838 B in 9, XLA's count; docs/inference.md section 6). Searched at the model's
    overhead too and the cheaper of the two continued (stop 37), section 14's 25 programs
    ended the same on 18, dearer on 3 (Gemma-2 204,678 B in 14 collectives where 210,438
    in 15; the sort-dispatched MoE 127,686 in 25 where 139,894 in 34; muon 12,160 in 6
    where 13,056 in 7), cheaper on 2 (the ragged MoE 29,558 where 23,686; the replicated
    Shampoo 21,910 in 10 where 21,260 in 5), for twice this search's time (the Llama scan
    3.04 s CPU where 1.67, the default overhead's search alone 1.23).

    On a program with repeated layers (:attr:`_Search.layers`: the seeded search,
    :func:`_seeded`) the common descent and the regrouping are left out, as
    :func:`_commoned` leaves its common descent out: both walk the whole program (the
    regrouping a whole combiner walk per move no dearer, ~40 ms at 16 layers) and grow
    faster than it. On Llama's adamw step (Megatron plan) at 3, 4, 8 and 16 layers on dp=2
    x tp=4 they took 0.5, 0.6, 2.3 and 8.9 s CPU of cold predicts of 3.0, 3.5, 6.4 and
    16.0 s (at 16 layers XLA compiles the step in ~12.6 s: 1.27x its time, now 0.56x) for
    the same bytes and collectives after XLA's combiner (one planned collective more, which
    the combiner merges); on dp=4 x tp=2 the result without them is cheaper by the objective
    (3 layers 452,020 -> 396,014, 39 -> 29 collectives after the combiner for 276,532 ->
    294,446 B; 8 layers 1,125,300 -> 994,030, 89 -> 64), on (8,) the same (stop 45;
    benchmarks/dump_predictions.py's 4-layer line one planned collective more, section 14's
    programs unchanged)."""
    model = search.repriced(compiled=True, overhead=overhead)
    offered = _repriced_paths(search, model, chosen)
    found = _partly(model, model.improve(chosen, values=True, reducing=True, pulls=True, offered=offered))
    # then value moves into a layout every consumer can take: the float32 Llama scan's loss (its logits' 4
    # consumers) moved to the sequence split at once, 112,912 -> 112,336 (what the search reached before the
    # masked lookup of take_along_axis, whose vocabulary-split loss no single-equation move leaves); with keeping
    # cascades too: a loop re-chosen to carry a value reduced, its consumers after the loop left as they are
    # (Equinox's scan 24,778 -> 24,586 B, 8 -> 7 collectives after the combiner). The cheaper by the model's
    # objective, which charges each collective its overhead already, as XLA's combiner leaves them
    # (:meth:`_Search.grouped`)
    if not search.walks_whole:
        kept = found
    else:
        kept = min((found, _common_descent(model, found, latency=True)), key=model.grouped)
        # then the ties the descents cannot tell apart, by the collectives after the combiner (MultiSteps 10 -> 9)
        kept = model.regrouped(kept)
    # bounded, or its start (bounded already), whichever is cheaper by the model: beyond eager's bytes, eager's choice
    # alone was the fallback, dearer than the start: optax.MultiSteps' Megatron MLP step descended to XLA's plan
    # (2,436 B, above eager's 1,414) and fell back to eager's, 1,408 B in 6 collectives, where its start sends 896
    # in 3 (the dense value_and_grad of tests/test_inference_program.py keeps eager's there: its start returns a
    # free gradient split over dp, dearer by the move to eager's layout the objective charges it)
    return min((_bounded(model.planned(), eagers, kept), chosen), key=model.grouped)


def _polished(model: _Search, eagers: tuple[Choice, Choice], chosen: Choice) -> Choice:
    """``chosen`` or, where cheaper on :func:`_descended`'s terms and bounded as every result
    is (:func:`_bounded`), its descent offering, besides the plain moves
    (:meth:`_Search.alternatives`), every other candidate of each equation where something
    costs, each alone (:meth:`_Search.every_candidate`): the search's last step, from its
    result, so that it never ends dearer than the result it is given. The descents before
    it reach their result by cascades and by moves where inputs are redistributed or
    partials made, and do not re-choose an equation alone to make what its consumers take
    (docs/inference.md section 6, "The polish"). On benchmarks/dump_predictions.py's 19
    programs it lowers 5, none dearer, every output's layout as it was: Llama's 2x4 adamw
    step 143,782 -> 140,710 B (82 -> 81 planned collectives, one all-gather fewer after
    XLA's combiner), the 8-device one 152,551 -> 145,383 (3 -> 2 all-gathers), its 4-layer
    one one planned collective fewer, Equinox's adamw step 48,576 -> 48,192 and Flax NNX's
    45,536 -> 45,344; it costs ~2% of a cold predict (0.09 s CPU of Llama's 2-layer step).
    One prediction measured dearer (stop 60): a residual scan's gradient on 4x2
    (tests/test_inference_carry.py), whose searches each end cheaper polished, but
    :func:`.jaxpr._resolve_carries` keeps among its carries' restarts the one least by
    bytes (with its free outputs' moves) before steps, not by the objective: 15,808 B in 23
    steps where 15,936 in 13, 91,456 by the objective where 90,240; check's objective
    113,536 where 100,608 (17,600 B in 17 collectives after XLA's combiner where 15,552 in
    11; XLA's 170,320). Since stop 61 the restarts compare by the objective within eager
    dispatch's bytes (:func:`.jaxpr._cheapest`): 26,368 B in 14, 94,272 by check's."""
    found = _descended(model, chosen, model.improve(chosen, every=True))
    if found == chosen:
        return chosen
    return min((_bounded(model.planned(), eagers, found), chosen), key=model.grouped)


def _eagers(graph: ProgramGraph, dispatched_choice: tuple[int, ...] | None) -> tuple[Choice, Choice]:
    """The eager choice (every node's first candidate) and eager dispatch's own choice where
    known (see _dispatched_choice; else the eager one): the bound of :func:`_bounded`."""
    eager = {node.path: 0 for node in graph.nodes}
    return eager, eager if dispatched_choice is None else dict(zip(eager, dispatched_choice))


def _repriced_paths(search: _Search, other: _Search, choice: Choice) -> list[str]:
    """The equations (in program order) producing or reading a value ``other`` prices
    otherwise than ``search`` at ``choice``, and their neighbours: where a descent priced by
    ``other`` starts from a choice that ends ``search``'s descents (elsewhere the two price
    every move alike; on Llama's 2x4 adamw step offering these first, not every equation,
    took the escape from 0.20 to 0.08 s CPU, the same result)."""
    paths: dict[str, None] = {}
    for v, value in enumerate(search.priced):
        if search.value_cost(v, choice) == other.value_cost(v, choice):
            continue
        if value[0] in ("literal", "owed"):
            paths[value[1]] = None
            continue
        if value[0] != "in":
            paths[value[0]] = None
        paths.update(dict.fromkeys(search.consumer_paths[value]))
    for path in list(paths):  # and their neighbours (a value move there reaches the 8-device GPT-2 step's basin)
        paths.update(dict.fromkeys(search.neighbours[path]))
    return sorted(paths, key=search.position.__getitem__)


def _choose(
    graph: ProgramGraph, cost_model: CostModel, targets: tuple[Layout | None, ...],
    callers: tuple[Layout | None, ...] | None, seeds: tuple[tuple[str, int], ...],
    dispatched_choice: tuple[int, ...] | None, overhead: Overhead | None = None, search: _Search | None = None,
) -> tuple[Choice, tuple[Choice, ...]]:
    """:func:`_select`'s choice (module docstring) and the compiled descents' results whose
    chain the planner's result took over (:func:`_escaped`'s other starts; none from a
    seeded or planner-priced search); ``overhead``: bytes per collective (None: the model's
    ``collective_overhead``); ``search``: the graph's search at that overhead where the
    caller has it (None: made here)."""
    eager, dispatched = _eagers(graph, dispatched_choice)
    if search is None:
        # priced as the backend compiles the moves
        search = _Search(graph, cost_model, targets, callers, overhead=overhead)
    if search.layers:  # repeated layers: seeded from them (:mod:`.blocks`)
        return _seeded(search, search.layers, seeds, dispatched_choice, (eager, dispatched)), ()
    if search.as_planned:
        chosen = _descend(search, eager, seeds)
        return _finish(search, search, (eager, dispatched), eager, chosen), ()
    # Priced by the planner alone (a reduce-scatter half an all-reduce), the descents end in other basins:
    # both are searched, the cheaper as compiled kept (the planner's result is 0.66x the bytes as compiled
    # on GPT-2's adamw step, 1.05x on Llama's). As compiled, only from the walked start, without seeds: on
    # the training steps the eager start and the seeds never gave the kept result.
    planned = search.repriced(compiled=False)
    by_planner = _descend(planned, eager, seeds)

    def cost(choice: Choice) -> tuple[Cost, Cost]:
        # ties as compiled broken by the planner's prices: CPU XLA sends a bfloat16 partial reduced in the program in
        # float32, what the float32 output it is cast to would owe, where a backend that does not widen sends half
        return search.total(choice), planned.total(choice)

    chains, replaced = [], []
    for pulls in (False, True):  # without and with pull moves (:meth:`_Search.pull_moves`), the cheaper kept
        search.tie_moved(not pulls)  # without pull moves, ties broken by the fewest inputs moved (tie_moved())
        chosen = _descend(search, eager, (), walked_only=True, pulls=pulls)
        if cost(by_planner) < cost(chosen):
            replaced.append(chosen)
            chosen = by_planner
        chains.append((pulls, chosen))
    # both chains are finished, the cheaper result kept: the dearer chain's finish can end cheaper (Llama's adamw
    # step on (8,): 160,615 B where 183,463), for one more finish where they do not tie (+0.23 s CPU, 8%, on Llama's
    # 2-layer step's cold predict)
    results = []
    for pulls, chosen in chains:
        search.tie_moved(not pulls)
        results.append((_finish(search, planned, (eager, dispatched), by_planner, chosen, pulls, partly=False), pulls))
    # then the kept result's one-dim-reduced descent (_partly), as the seeded search's one finish of the whole has
    # it: run in both chains' finishes, it took the dearer chain of Llama's 3-layer adamw step (dp=2 x tp=4) into a
    # basin the seeded search does not reach (search alone 178,554 B in 58 collectives after the combiner where
    # seeded 182,154 in 34, tests/test_inference_blocks.py); from the kept result alone it still finds the four
    # improvements of benchmarks/dump_predictions.py it found from both
    kept, pulls = min(results, key=lambda result: cost(result[0]))
    search.tie_moved(not pulls)
    kept = _bounded(planned, (eager, dispatched), _descended(search, kept, _partly(search, kept)), by_planner)
    return kept, tuple(replaced)


def _seeded(
    search: _Search, layers: list[blocks.Block], seeds: tuple[tuple[str, int], ...],
    dispatched_choice: tuple[int, ...] | None, eagers: tuple[Choice, Choice],
) -> Choice:
    """The choice of a program with repeated layers (:mod:`.blocks`): the reduced graph's
    (its blocks' first and last copies) tiled over the middle copies from the first or the
    last, the cheaper; block copies copied onto others while that is cheaper, sweep after
    sweep until one changes nothing; then the finishing descent, bounded as every choice
    is (:func:`_finish`; where the result would send more than eager dispatch, the tiled
    choice in the planner's result's place, then eager's).

    The sweeps, measured on Llama's adamw step (Megatron dp=2 x tp=4, load ~3): at 3 / 4 /
    8 / 16 layers the first lowers the objective by 6,816 (3 collectives fewer: 207,796 ->
    200,980 / 265,396 -> 258,580 / 495,796 -> 488,980 / 956,596 -> 949,780) and the second
    changes nothing, so the fixed point is the first sweep's, found in two sweeps as the two
    fixed sweeps before it did (the same predictions; 19 / 22 / 46 / ~100 ms CPU, one sweep
    half that). The reduced graph is searched by :func:`_choose`, which looks for blocks
    there too: it would find a stack of layers of another depth than the one reduced
    (tests/test_inference_blocks.py); on Llama's step none is (the look costs 41 /
    41 / 42 / 47 ms CPU at 3 / 4 / 8 / 16 layers, 1.4-0.9% of the selection, load 5-6)."""
    paths = search.paths
    reduced, outputs = blocks.reduce(search.graph, layers)
    kept = {node.path: search.position[node.path] for node in reduced.nodes}
    sub, _ = _choose(
        reduced, search.cost_model, tuple(search.targets[o] for o in outputs),
        tuple(search.callers[o] for o in outputs),
        tuple(seed for seed in seeds if seed[0] in kept),
        None if dispatched_choice is None else tuple(dispatched_choice[p] for p in kept.values()), search.overhead,
    )
    seed = min((blocks.tiled(sub, paths, layers, copy) for copy in (0, -1)), key=search.total)
    chosen, best = seed, search.total(seed)
    lowered = True
    while lowered:  # sweeps until one changes nothing (each change lowers the total: it ends)
        lowered = False
        for block in layers:
            for source, onto in blocks.copy_moves(block):
                trial = blocks.copied(chosen, paths, block, source, onto)
                cost = search.total(trial)
                if cost < best:
                    chosen, best, lowered = trial, cost, True
    planned = search.planned()
    offered = [paths[p] for p in blocks.boundaries(layers, len(paths))]  # moves at the blocks' seams first
    return _finish(search, planned, eagers, seed, chosen, offered=offered)


def _finish(
    search: _Search, planned: _Search, eagers: tuple[Choice, Choice], by_planner: Choice, chosen: Choice,
    pulls: bool = False, offered: Collection[str] | None = None, partly: bool = True,
) -> Choice:
    """One last descent with reducing cascades (:meth:`_Search.reducing_moves`), kept on
    the value moves' terms; never more bytes than eager dispatch, priced by the planner
    (:func:`_bounded`). ``eagers``: the walk's first candidates and eager dispatch's own
    choice; ``offered``: the equations offered moves first (:meth:`_Search.improve`);
    ``partly``: ending with the one-dim-reduced descent (:func:`_partly`; else the caller
    runs it on the result it keeps)."""
    found = search.improve(chosen, values=True, reducing=True, pulls=pulls, offered=offered)
    # then split values near the outputs gathered, from that result (so never dearer than it): offered from the
    # finish's start they led its descent to another basin (the stacked LM's accumulated bfloat16 step 9,776 ->
    # 15,920 B as compiled)
    found = search.improve(
        found, values=True, reducing=True, gathers=True, pulls=pulls, offered=search.near_gathered, carry_pulls=True
    )
    return _bounded(planned, eagers, _descended(search, chosen, _partly(search, found) if partly else found),
                    by_planner)


def _partly(search: _Search, choice: Choice) -> Choice:
    """A descent from ``choice`` with pull moves reducing one mesh dim's partial upstream
    where an input arrives partial on several too (:func:`_one_reduced`), offered there
    first. From a finish's result: offered at the start of the finish, the clip's norm
    met its gradients in other layouts than those the finish's gathers leave; in every
    pull descent, they led the stateful nnx.jit adamw step of
    benchmarks/dump_predictions.py to another basin (44,576 -> 44,720 B). Pulls through
    diamonds here (:meth:`_Search._pull`), offered also where an input arrives split over
    several mesh dims and is gathered over some (:func:`_one_gathered`)."""
    return search.improve(
        choice, values=True, reducing=True, pulls=True, offered=search.multi_partial(choice), partly=True
    )


def _descended(search: _Search, chosen: Choice, found: Choice) -> Choice:
    """``found``, descended from ``chosen``, where it costs less in no more planned
    collectives, or no more in fewer collectives after XLA's combiner
    (:meth:`_Search.grouped`), else ``chosen``."""
    if found == chosen:
        return chosen
    best, cost = search.total(chosen), search.total(found)
    # the groups found only where the planned count does not decide (rare: each walks the whole choice)
    if cost < best and cost[1] <= best[1] or cost[0] <= best[0] and search.grouped(found)[1] < search.grouped(chosen)[1]:
        return found
    return chosen


def _bounded(
    planned: _Search, eagers: tuple[Choice, Choice], chosen: Choice, by_planner: Choice | None = None
) -> Choice:
    """``chosen``, the planner's result (``by_planner``) or eager's (:func:`_finish`'
    ``eagers``), the first sending no more bytes than eager dispatch by the planner's
    prices."""
    # never more bytes than eager dispatch, priced by the planner (as the prediction is; eager's own routes, without
    # the overhead): the overhead per collective trades bytes for fewer collectives, never beyond eager's bytes.
    # The bytes as walked: the first candidates' walk (no choices) routes without the overhead, a choice's with it
    eager = eagers[0]

    def walked(choice: Choice) -> float:
        return planned.plain_bytes(choice) if choice == eager else planned.walked_bytes(choice)

    limit = min(map(planned.plain_bytes, eagers))
    options = (chosen, *(() if by_planner is None else (by_planner,)), *eagers)
    return next((option for option in options if walked(option) <= limit), min(options, key=walked))


def _chosen(graph: ProgramGraph, eager: Choice, chosen: Choice) -> dict[str, Candidate]:
    """The candidates of ``chosen``; empty when it is the eager choice."""
    if chosen == eager:
        return {}
    return {node.path: node.candidates[chosen[node.path]] for node in graph.nodes}


def _descend(
    search: _Search, eager: Choice, seeds: tuple[tuple[str, int], ...], walked_only: bool = False, pulls: bool = False
) -> Choice:
    """The search's descents (module docstring) from the eager choice: the best choice
    found, ``eager`` itself when none is cheaper. ``walked_only``: from the walked start
    alone (:meth:`_Search.starts`' last); ``pulls``: pull moves offered too."""
    chosen, best = eager, search.total(eager)
    origin = eager
    starts = search.starts(eager)
    for start in starts[-1:] if walked_only else starts:
        found = search.improve(start, pulls=pulls)
        cost = search.total(found)
        if cost < best:
            chosen, best, origin = found, cost, start
    # value moves: continuing from the best result, and descending with them from its start (two basins: on the
    # GPT-2 adamw step the second is 0.89x the first's bytes, on Llama's 1.19x); one descent when no start's
    # descent moved (the result is its start: improve() is a function of its start and options)
    froms = (chosen,) if chosen == origin else (chosen, origin)
    for found in [search.improve(start, values=True, pulls=pulls) for start in froms]:
        cost = search.total(found)
        if cost < best and cost[1] <= best[1]:
            chosen, best = found, cost
    for path, k in seeds:  # from the best choice with one node re-chosen (cascading), descended again
        trial = dict(chosen)
        search.cascaded({path: k}, trial)  # leaves the trial changed
        found = search.improve(trial, pulls=pulls)
        cost = search.total(found)
        if cost < best and cost[1] <= best[1]:
            chosen, best = found, cost
    return chosen


Choice = dict[str, int]  # equation path -> index of its candidate
# (equation path, candidate, cascade downstream?), or (_VALUE, path, output, ((consumer, candidate), ...), cascade
# downstream?, strict: taken only adding no collective): every consumer of one value re-chosen at once, or
# (_REDUCING, path, candidate): a reducing cascade (:meth:`_Search.reducing_moves`), or (_KEEPING, path, candidate):
# a keeping cascade (:meth:`_Search.keeps`), or (_PULL / _KEEPING_PULL, path, input, ((producer, candidate), ...)): a
# pull move (:meth:`_Search.pull_moves`), its cascade a keeping one
Move = tuple[Any, ...]
_VALUE = "<value>"
_REDUCING = "<reducing>"
_PULL = "<pull>"
_REDUCED = "<reduced>"
_KEEPING = "<keeping>"
_KEEPING_PULL = "<keeping pull>"
# the moves whose first item names their kind, not their equation
_KINDS = (_VALUE, _REDUCING, _PULL, _REDUCED, _KEEPING, _KEEPING_PULL)
_PULL_DEPTH = 12  # producers re-chosen upstream at most by one pull move
# and by one pulling one mesh dim's partial reduced (_one_reduced), which steps past free moves: the float32 Llama
# scan's norm sums the squares of 12 gradients (a depth of 12 left its dp all-reduce)
_PARTLY_DEPTH = 64
# how far upstream of an output with a fixed layout value_moves() gathers a split value's consumers: an adamw update
# of a clipped gradient is 4 equations from its gradient's consumers to the updated moment
_NEAR_OUTPUT = 4
State = tuple[Any, ...]  # a layout's (dim_axes, partial[, split_factors]) on the one mesh
AvalKey = tuple[tuple[int, ...], np.dtype]
# (weighted bytes plus the overhead per collective, collectives), compared lexicographically: among equally cheap
# choices the one with fewer collectives. Floats for speed (exact for the usual dyadic byte counts; the order of
# summation is fixed, so results are deterministic).
Cost = tuple[float, float]
_ZERO: Cost = (0.0, 0.0)
# a delta known not to lower the total (:meth:`_Search.delta`): never applied, its amount not needed
_NOT_LOWER: Cost = (math.inf, math.inf)

# An evaluation whose cascade looked at more than this fraction's inverse of the program (~500 of the 4,017 equations
# of Llama's 8-layer adamw step) is kept with every choice (:meth:`_Search.evaluate`)
_WHOLE = 8

# a move's (delta, changes, depends: the equations it depends on as a bit set by position), see _Search.evaluate
Evaluation = tuple[Cost, dict[str, int], int]
# an evaluation's depends (as above), the getter of the choices it reads and the values its delta prices
_Reading = tuple[int, Callable[[Choice], Any], Collection[int]]


def _backend_rules(mesh: DeviceMesh) -> CombinerRules | None:
    """The rules of what ``mesh``'s backend compiles a planned collective as (:mod:`.combine`:
    CPU XLA forms no reduce-scatter, it all-reduces the whole block, twice the bytes, and
    sends a ``bfloat16`` collective in ``float32``, twice its bytes); None on a platform
    without rules (priced by the planner alone)."""
    platform = mesh.devices.flat[0].platform
    return combiner_rules(platform) if platform in BACKENDS else None


def _unwidened(dtype: np.dtype) -> int:
    """Every element type sent as planned (the planner's prices)."""
    return 1


def _upstream(
    sources: dict[str, Any], starts: Iterable[ValueId], depth: int, joins: Mapping[ValueId, tuple[ValueId, ...]]
) -> frozenset[str]:
    """The equations at most ``depth`` equations upstream of the values ``starts`` (their
    producers included), by their inputs' ``sources`` (the function's inputs left out); a
    cond's output made, at its depth, by what its branches return for it (``joins``:
    :attr:`ProgramGraph.joins`), since the cond's node reads its index alone."""

    def producers(values: Iterable[ValueId]) -> set[str]:
        return {v[0] for value in values for v in (value, *joins.get(value, ())) if v[0] != "in"}

    found = producers(starts)
    frontier = set(found)
    for _ in range(depth):
        frontier = producers(src for path in frontier for src in sources[path] if src is not None) - found
        found |= frontier
    return frozenset(found)


def _getter(paths: Sequence[str]) -> Callable[[Choice], Any]:
    """The choices of ``paths`` in a choice, as a hashable memo key (:func:`operator.itemgetter`:
    a third of the time of ``tuple(map(choice.__getitem__, paths))`` on the search's keys;
    one path gives its choice alone, no paths an empty tuple)."""
    if not paths:
        return lambda choice: ()
    return itemgetter(*paths)


def _one_dim_apart(state: State, other: State) -> bool:
    """Whether ``other`` places ``state``'s value otherwise on one mesh dim alone (its split
    gathered, moved to another tensor dim or made: one all-gather, all-to-all or slice of the
    value), its partials and strides alike."""
    if state[1:] != other[1:]:
        return False

    def placed(dim_axes: tuple[tuple[int, ...], ...]) -> dict[int, tuple[int, int]]:
        return {m: (d, k) for d, axes in enumerate(dim_axes) for k, m in enumerate(axes)}

    here, there = placed(state[0]), placed(other[0])
    return sum(here.get(m) != there.get(m) for m in here.keys() | there.keys()) == 1


def _taken_as_made(
    state: State, needs: tuple[State, ...], takes: Sequence[dict[State, Any]]
) -> tuple[State, ...]:
    """The layouts :meth:`_Search.value_moves`' ``common`` also offers as strict moves for
    a value made in ``state`` (without partials) whose consumers need it in ``needs`` and
    can take it in the layouts ``takes`` (per consumer, its candidates by input layout):
    ``state`` itself where some consumer moves it (every consumer taking it as it comes),
    and a strided ``state`` with its one strided mesh dim gathered to a plain layout (one
    all-gather; :func:`_one_dim_apart` keeps strides alike). A CNN's flattened
    channel-split activations (``S(0),_S(1, 16)``) gathered over ``tp`` alone for the logits
    and the dense gradient, then the logits' gradient taken as it comes (split over ``dp``)
    by the bias and flat gradients: tests/models/cnn.py's one-conv step, 32,548 -> 22,188 by
    the latency-bound default's objective (XLA's plan: 13,804 B in 2 collectives after the
    combiner where 7,780 in 4, three of them all-gathers)."""
    found: list[State] = []
    if any(need != state for need in needs):
        found.append(state)
    if len(state) > 2:
        strided = {m for m, f in enumerate(state[2]) if f != 1}
        plain = (tuple(tuple(a for a in axes if a not in strided) for axes in state[0]), state[1])
        if len(strided) == 1 and all(plain in take for take in takes):
            found.append(plain)
    return tuple(found)


def _splits(state: State) -> int:
    """How many mesh dims split ``state``'s value."""
    return sum(map(len, state[0]))


def _partial_dims(states: Sequence[State]) -> frozenset[int]:
    """The mesh dims some of ``states`` is partial on."""
    return frozenset(m for state in states for m, op in enumerate(state[1]) if op)


def _one_reduced(arriving: State, need: State) -> list[State]:
    """An input arriving partial on several mesh dims, some of which its consumer needs
    reduced: per such mesh dim, the arriving state with that partial alone reduced (to
    Replicate there), which :meth:`_Search.pull_moves` also pulls upstream. A clip's
    global norm sums each gradient's squares, some computed on a free ``dp`` slice of a
    replicated gradient (partial over ``dp`` and ``tp``), others replicated over ``dp``:
    pulled as the ``sqrt`` needs it (Replicate) the chain stops at the gradients split over
    ``tp``; reduced over ``dp`` only, every producer of a ``dp`` partial is re-chosen at
    once and the scalar's ``dp`` all-reduce goes."""
    partial = arriving[1]
    if sum(1 for op in partial if op) < 2:
        return []
    reduced = [
        (arriving[0], tuple(None if n == m else op for n, op in enumerate(partial)), *arriving[2:])
        for m, op in enumerate(partial) if op and not need[1][m]
    ]
    return [state for state in reduced if state != need]


def _one_gathered(arriving: State, need: State) -> list[State]:
    """An input arriving split over several mesh dims, some of which its consumer needs
    gathered (the others kept as they are): per such mesh dim, the arriving state with that
    split alone gathered (plain splits only). :meth:`_Search.multi_partial` offers the
    one-dim-reduced descent there too: a small CNN's logits, sliced for free from the ``dp``-split activations to
    ``(dp,tp)`` and their whole loss chain after them, were all-gathered over ``tp`` and
    ``dp`` for the replicated dense gradient; pulled from that gather (a diamond of the
    chain, :meth:`_Search._pull`'s ``diamonds``) the chain runs split over ``dp`` alone and
    the ``tp`` all-gather goes (tests/models/cnn.py's two-conv step)."""
    if len(arriving) > 2 or len(need) > 2 or arriving[1] != need[1]:
        return []
    split = {m for axes in arriving[0] for m in axes}
    kept = {m for axes in need[0] for m in axes}
    if len(split) < 2 or need[0] != tuple(tuple(a for a in axes if a in kept) for axes in arriving[0]):
        return []  # not gathered alone (a split moved too)
    gathered = [
        (tuple(tuple(a for a in axes if a != m) for axes in arriving[0]), arriving[1])
        for m in sorted(split - kept)
    ]
    return [state for state in gathered if state != need]


def _state(layout: Layout) -> State:
    """The planner's state (:func:`.plan.layout_state`: split factors too, when strided),
    without the placements on size-1 mesh dims (those of a plain layout): on one device
    every placement holds the whole tensor, so they cost nothing (the planner routes around
    them, :class:`.plan._TrivialDims`), a partial there is nothing to reduce and no
    collective to count, and layouts differing only there are one state. So the search on
    a (1, 8) mesh is the search on (8,) (GPT-2's adamw step: 69,671 B predicted against
    59,367 B on (8,) when a partial over ``dp`` counted a collective in the objective and
    made the equation one that "makes a partial")."""
    state = layout_state(layout)
    trivial = [m for m, n in enumerate(layout.mesh.shape) if n == 1]
    if not trivial or len(state) > 2:
        return state
    return (
        tuple(tuple(a for a in axes if a not in trivial) for axes in state[0]),
        tuple(None if m in trivial else op for m, op in enumerate(state[1])),
    )


class _States(dict):  # type: ignore[type-arg]
    """Layouts' states (:func:`_state`) by interned layout, each computed at its first
    look-up (``__missing__``), and per state the first layout found for it (``layouts``):
    the search converts its candidates' layouts by mapping ``__getitem__`` over them (in C,
    not a method per layout), and :class:`_Candidates` indexes them column by column: the
    search's construction 0.86x its time on Llama's adamw step (~12k candidates), 0.83x on
    GPT-2's (medians of 30 alternated in one process, load 8-10; the same tables)."""

    __slots__ = ("layouts",)

    def __init__(self) -> None:
        super().__init__()
        self.layouts: dict[State, Layout] = {}

    def __missing__(self, layout: Layout) -> State:
        state = self[layout] = _state(layout)
        self.layouts.setdefault(state, layout)
        return state


class _StateTuples(dict):  # type: ignore[type-arg]
    """The states of layout tuples (a candidate's inputs or outputs) by tuple, each
    converted at its first look-up (``__missing__``): the search maps ``__getitem__`` over
    its candidates' layout tuples (in C; a tuple of interned layouts hashes by their
    identities), and candidates repeat theirs (on Llama's adamw step 1,974 distinct input
    tuples and 358 output tuples among 11,574 candidates)."""

    __slots__ = ("state",)

    def __init__(self, states: _States) -> None:
        super().__init__()
        self.state = states.__getitem__

    def __missing__(self, layouts: tuple[Layout, ...]) -> tuple[State, ...]:
        states = self[layouts] = tuple(map(self.state, layouts))
        return states


def _positions(values: Sequence[Any]) -> dict[Any, Sequence[int]]:
    """Per distinct value (in order of first appearance), the positions holding it."""
    alone: dict[Any, Sequence[int]] = dict(zip(values, zip(itertools.count())))  # in C
    if len(alone) == len(values):  # all distinct: a candidate tuple's inputs (all of them, on the training steps)
        return alone
    found: dict[Any, list[int]] = {}
    for k, value in enumerate(values):
        positions = found.get(value)
        if positions is None:
            found[value] = [k]
        else:
            positions.append(k)
    return found


class _Candidates:
    """A node's candidates as states (per candidate, its inputs' and its outputs'), with
    the indices the search looks them up by instead of scanning them all (one per
    candidate tuple: a model's repeated layers and their gradients share theirs)."""

    def __init__(self, ins: tuple[tuple[State, ...], ...], outs: tuple[tuple[State, ...], ...], ndim: int) -> None:
        self.ins, self.outs = ins, outs
        columns = list(zip(*ins))  # per input, each candidate's state
        # per input, the distinct states candidates need it in (in order of first need) and each candidate's (by its
        # index there): an input's moves are priced once per distinct need (:meth:`_Search.input_costs`)
        self.needed = [tuple(dict.fromkeys(column)) for column in columns]
        self.need_index = [
            tuple(map({state: n for n, state in enumerate(needed)}.__getitem__, column))
            for needed, column in zip(self.needed, columns)
        ]
        self.ndim = ndim

    # The indices by state, built when the search first looks a node's candidates up so (:meth:`_Search._greedy`
    # by its inputs, :meth:`_Search.value_moves` by one input, :meth:`_Search._pull` by one output): built with
    # the needs for every candidate tuple, the tables took 36 ms of the search's 91 ms construction on Llama's
    # 2-layer adamw step (304 tuples, 11,574 candidates), the needs alone 12 ms.

    @functools.cached_property
    def by_ins(self) -> dict[tuple[State, ...], Sequence[int]]:
        """The candidates needing exactly these inputs."""
        return _positions(self.ins)

    @functools.cached_property
    def by_in(self) -> list[dict[State, Sequence[int]]]:
        """Per input, per state, the candidates needing it in that state."""
        return [_positions(column) for column in zip(*self.ins)]

    @functools.cached_property
    def by_out(self) -> list[dict[State, Sequence[int]]]:
        """Per output, per state, the candidates giving it in that state."""
        return [_positions(column) for column in zip(*self.outs)]

    # The tables of reducing moves (:meth:`_Search._alternatives`), built when a node with partials first needs
    # them (most nodes of a training step have none: a third of the candidates' conversion on Llama's).

    @functools.cached_property
    def partial_dims(self) -> list[frozenset[int]]:
        """Per candidate, the mesh dims its outputs are partial on."""
        return [frozenset(m for x in gives for m, op in enumerate(x[1]) if op) for gives in self.outs]

    @functools.cached_property
    def split_dims(self) -> list[frozenset[int]]:
        """Per candidate, the mesh dims its outputs are split over."""
        return [frozenset(m for x in gives for axes in x[0] for m in axes) for gives in self.outs]

    @functools.cached_property
    def unreduced(self) -> list[int]:
        """The candidates with no partial output."""
        return [k for k, dims in enumerate(self.partial_dims) if not dims]

    @functools.cached_property
    def unreduced_on(self) -> list[list[int]]:
        """Per mesh dim, the candidates with no output partial on it."""
        return [[k for k, dims in enumerate(self.partial_dims) if m not in dims] for m in range(self.ndim)]


class _Search:
    """The search over one graph, on layouts reduced to hashable states."""

    def __init__(
        self, graph: ProgramGraph, cost_model: CostModel, targets: tuple[Layout | None, ...],
        callers: tuple[Layout | None, ...] | None = None, compiled: bool = True, overhead: Overhead | None = None,
    ) -> None:
        self.graph = graph
        self.cost_model = cost_model
        self.targets = targets
        # per free output, the layout its caller takes it in (charge(); None: see select_program)
        self.callers = _callers(graph, targets) if callers is None else callers
        self.mesh_shape = graph.mesh.shape
        # the mesh dims' weights with the integral ones as ints: equal to their Fractions as keys of the planner's
        # caches (whose searches turn weights into integers themselves: the same results), and hashed in C at
        # each of them, where a Fraction's hash is Python code (on Llama's adamw step ~44k hashes of the cold search)
        self.weights = tuple(
            int(w) if w.denominator == 1 else w for w in map(Fraction, cost_model.weights(graph.mesh))
        )
        self.ins: dict[str, tuple[tuple[State, ...], ...]] = {}  # per node, per candidate
        self.outs: dict[str, tuple[tuple[State, ...], ...]] = {}
        self.in_avals: dict[str, tuple[AvalKey, ...]] = {}
        self.out_avals: dict[str, tuple[AvalKey, ...]] = {}
        self.fixed: dict[str, tuple[State | None, ...]] = {}  # per node input: its state if no equation chooses it
        self.arrivals: dict[str, tuple[tuple[State | None, str | None, int | None], ...]] = {}
        self.consumers: dict[ValueId, list[tuple[str, int]]] = {}
        self.sources = {node.path: node.sources for node in graph.nodes}
        self.states = _States()  # per interned layout (hashed by identity: cheap)
        self.layouts = self.states.layouts  # per state, the first layout interned as it
        intern = self.states.__getitem__
        convert = _StateTuples(self.states).__getitem__
        in_layouts, out_layouts = operator.attrgetter("in_layouts"), operator.attrgetter("out_layouts")
        # The states of a candidate tuple, converted once: a model's repeated layers and
        # their gradients share their (cached) signatures' candidate tuples.
        converted: dict[int, _Candidates] = {}
        self.candidates: dict[str, _Candidates] = {}
        # per node, its kind: nodes of one kind (candidates and avals) choose alike for the same inputs (greedy())
        kinds: dict[tuple[int, tuple[AvalKey, ...], tuple[AvalKey, ...]], int] = {}
        self.kinds: dict[str, int] = {}
        for node in graph.nodes:
            known = converted.get(id(node.candidates))
            if known is None:
                known = converted[id(node.candidates)] = _Candidates(
                    tuple(map(convert, map(in_layouts, node.candidates))),
                    tuple(map(convert, map(out_layouts, node.candidates))),
                    graph.mesh.ndim,
                )
            self.candidates[node.path] = known
            self.ins[node.path], self.outs[node.path] = known.ins, known.outs
            self.in_avals[node.path] = tuple((s.shape, s.dtype) for s in node.inputs)
            self.out_avals[node.path] = tuple((a.shape, a.dtype) for a in node.candidates[0].out_avals)
            kind = (id(known), self.in_avals[node.path], self.out_avals[node.path])
            self.kinds[node.path] = kinds.setdefault(kind, len(kinds))
            fixed = []
            for i, src in enumerate(node.sources):
                if src is None:
                    fixed.append(intern(node.inputs[i].layout))
                elif src[0] == "in":
                    fixed.append(intern(graph.inputs[src[1]].layout))
                else:
                    fixed.append(None)
                if src is not None:
                    self.consumers.setdefault(src, []).append((node.path, i))
            self.fixed[node.path] = tuple(fixed)
            # arriving()'s per input: its fixed state (a non-empty tuple), else its producer and output
            self.arrivals[node.path] = tuple(
                (state, None, None) if state is not None else (None, *src)  # type: ignore[misc]
                for state, src in zip(fixed, node.sources)
            )
        self.owed: dict[ValueId, list[State | None]] = {}
        for src, target in zip(graph.outputs, targets):
            if src is not None and src[0] != "in":
                self.owed.setdefault(src, []).append(None if target is None else intern(target))
        self.owing = frozenset(path for path, _ in self.owed)  # the equations making an output of the function
        self.taken = {  # per free output made by an equation, the state its caller takes it in (charge())
            src: intern(caller) for src, caller in zip(graph.outputs, self.callers)
            if src in self.owed and caller is not None
        }
        # the equations a few upstream of an output with a fixed layout (an optimizer's update of a parameter): the
        # consumers of a split value value_moves() gathers
        # (through a cond's branches: optax.novograd updates the first moment inside one)
        fixed_outputs = [value for value, targets in self.owed.items() if any(t is not None for t in targets)]
        # per aval, the layouts the function's fixed outputs of that aval keep, partials none (a parameter's, its
        # optimizer state's): a partial gradient near them reduced into one (value_moves())
        self.kept_states: dict[AvalKey, tuple[State, ...]] = {}
        for value in fixed_outputs:
            aval = self.out_avals[value[0]][value[1]]
            kept = (t for t in self.owed[value] if t is not None and not any(t[1]))
            self.kept_states[aval] = tuple(dict.fromkeys((*self.kept_states.get(aval, ()), *kept)))
        joins = dict(graph.joins)
        self.near_fixed_outputs = _upstream(self.sources, fixed_outputs, _NEAR_OUTPUT, joins)
        self.near_gathered = _upstream(self.sources, fixed_outputs, _NEAR_OUTPUT + 1, joins)  # and the producers
        # per equation near those outputs making a value of an aval some of them keeps: (output, the layouts kept)
        # per such output (a strict value move's cascade reduces a partial into one, :meth:`_greedy_kept`)
        self.kept_ahead: dict[str, tuple[tuple[int, tuple[State, ...]], ...]] = {}
        for path in self.near_fixed_outputs:
            kept_outputs = tuple(
                (j, self.kept_states[aval]) for j, aval in enumerate(self.out_avals[path]) if self.kept_states.get(aval)
            )
            if kept_outputs:
                self.kept_ahead[path] = kept_outputs
        self.position = {node.path: p for p, node in enumerate(graph.nodes)}
        # per (consumer, value), where its move of the value runs, then the computations whose moves it sees
        # (.combine.move_computations): a value's consumers share a move only there (value_cost(), shared_needs())
        within = move_computations(dict(graph.loops))
        self.within = {(c, value): within(c, value)
                       for value, consumers in self.consumers.items() for c, _ in consumers}
        self.paths = [node.path for node in graph.nodes]  # by position
        # Neighbour tables, so that the hot loops loop over no consumers:
        # per node, the values its evaluations price (each input's source or literal, then each output, then what
        # each output of the function owes, charge(), as one more value: by their ids, below), what cascaded()
        # adds to its depends (the consumers of each source, the producer, the consumers of each output), and
        # its outputs' consumers with their positions; per value, its consumers' paths.
        touched: dict[str, tuple[Any, ...]] = {}
        self.neighbours: dict[str, frozenset[str]] = {}
        self.downstream: dict[str, tuple[tuple[str, int], ...]] = {}
        self.consumer_paths = {value: tuple(c for c, _ in consumers) for value, consumers in self.consumers.items()}
        for node in graph.nodes:
            path, outputs = node.path, range(len(self.out_avals[node.path]))
            priced = [src if src is not None else ("literal", path, i) for i, src in enumerate(node.sources)]
            owes = (("owed", path, j) for j in outputs if (path, j) in self.owed)
            touched[path] = (*priced, *((path, j) for j in outputs), *owes)
            near: set[str] = set()
            for src in node.sources:
                if src is not None:
                    near.update(self.consumer_paths[src])
                    if src[0] != "in":
                        near.add(src[0])
            for j in outputs:
                near.update(self.consumer_paths.get((path, j), ()))
            self.neighbours[path] = frozenset(near)
            self.downstream[path] = tuple(
                (c, self.position[c]) for j in outputs for c, _ in self.consumers.get((path, j), ())
            )
        # per node, its bit, and by position its bit and those of its neighbours: an evaluation's depends as a bit
        # set (by position), so that finding the evaluations an applied move makes stale is one AND each (improve())
        self.bits = {path: 1 << p for p, path in enumerate(self.paths)}
        self.reach = [
            self.bits[path] | functools.reduce(operator.or_, map(self.bits.__getitem__, self.neighbours[path]), 0)
            for path in self.paths
        ]
        # value_cost() per value and the choices it reads (its producer's, unless an input, and its consumers'):
        # one search prices with one cost model, so a value's cost is fixed by those choices
        deciders = {
            value: _getter((() if value[0] == "in" else (value[0],)) + paths)
            for value, paths in self.consumer_paths.items()
        }
        for path, values in touched.items():  # a literal's: its consumer's choice; a charge's: its producer's
            chosen = _getter((path,))
            deciders.update((value, chosen) for value in values if value[0] in ("literal", "owed"))
        # The values priced, by id (an int hashes and compares faster than a (path, output) tuple: the
        # delta of every evaluation looks its values up twice), and their deciders by id; an output no
        # equation consumes costs nothing and has none.
        self.priced = list(deciders)
        self.deciders = list(deciders.values())
        ids = {value: n for n, value in enumerate(self.priced)}
        self.touched = {
            path: tuple(dict.fromkeys(ids[value] for value in values if value in ids))
            for path, values in touched.items()
        }
        # value_cost()'s per value (by id) of an edge: its aval, its state if fixed (a function's input), and its
        # consumers' candidates' input states, paths, input indices and computations
        self.readers = [
            None if value[0] in ("literal", "owed") else (
                self.in_avals[consumers[0][0]][consumers[0][1]], self.fixed[consumers[0][0]][consumers[0][1]],
                tuple((self.ins[c], c, i, self.within[c, value]) for c, i in consumers),
            )
            for value, consumers in zip(self.priced, map(self.consumers.get, self.priced))
        ]
        # total()'s: every value, every node's choice (its memo key)
        self.values = self.touched_by(self.paths)
        self.everything = _getter(self.paths)
        # the producers of each node's inputs not fixed (greedy()'s memo key: see _price())
        self.producers = {
            node.path: tuple(src[0] for src, fixed in zip(node.sources, self.fixed[node.path]) if fixed is None)
            for node in graph.nodes
        }
        # the nodes stacking a loop body's value (ProgramNode.stacks) and what greedy() reads per node: its
        # producers' choices, and a stacking node's consumers' too (its look-ahead); and the getter of those
        # choices (greedy()'s memo key)
        self.stacking = frozenset(node.path for node in graph.nodes if node.stacks)
        self.greedy_reads = {
            path: producers + (self.consumer_paths.get((path, 0), ()) if path in self.stacking else ())
            for path, producers in self.producers.items()
        }
        self.greedy_choices = {path: _getter(reads) for path, reads in self.greedy_reads.items()}
        # evaluate()'s per equations looked at (by position) and changes (in order): the evaluation's depends, the
        # getter of the choices it reads and the values its delta prices, built once (on Llama's adamw step its 9,197
        # evaluations looked at and changed 2,382 distinct sets of equations, ~21 and ~19 of them, reading ~68
        # choices: building those per evaluation was ~13 us of its bookkeeping); alike for every pricing
        # (repriced() shares it)
        self.readings: dict[tuple[frozenset[int], tuple[str, ...]], _Reading] = {}
        # cascaded()'s per node by position: its path, the getter of the choices its greedy() reads, and its
        # outputs' consumers' positions, queued, and those of its followers (:meth:`followers`), re-chosen at once
        followers = self.followers()
        self.steps = [
            (
                path, self.greedy_choices[path],
                tuple(dict.fromkeys(p for c, p in self.downstream[path] if c not in followers[path])),
                tuple(self.position[c] for c in followers[path]),
            )
            for path in self.paths
        ]
        # alternatives() per node and the choices it reads (its own, its producers', its outputs' consumers'):
        # the descents revisit the same neighbourhoods (from each start, with and without pull moves)
        self.local_deciders = {
            path: _getter((path, *self.producers[path], *dict.fromkeys(c for c, _ in self.downstream[path])))
            for path in self.position
        }
        # and, for the finishing descent's shared-input moves, the other consumers of its inputs' values
        self.sharers = {
            path: _getter(tuple(dict.fromkeys(c for src in self.sources[path] if src is not None
                                              for c in self.consumer_paths[src])))
            for path in self.position
        }
        # moved_equations()': the loops XLA compiles as loops, the scans of one trip (path -> position of their
        # body's first node), and per position the scans opening there, and per such scan's position, where it opens
        self.loops, self.inlined = dict(graph.loops), dict(graph.inlined)
        self.openings: dict[int, list[ProgramNode]] = {}
        self.opened_at: dict[int, int] = {}
        for node in graph.nodes:
            if node.path in self.inlined:
                self.openings.setdefault(self.inlined[node.path], []).append(node)
                self.opened_at[self.position[node.path]] = self.inlined[node.path]
        # repriced()'s searches per pricing, shared by every search of the graph (a copy shares this dict)
        self.repricings: dict[tuple[bool, Overhead, bool], _Search] = {}
        self._price(compiled, cost_model.collective_overhead if overhead is None else overhead)

    def followers(self) -> dict[str, tuple[str, ...]]:
        """Per node, its *followers*: the consumers whose inputs not fixed all come from
        it, later in program order, whose outputs' consumers all come later still, neither
        of the two stacking (:attr:`ProgramNode.stacks`: its :meth:`greedy` reads its
        consumers' choices). :meth:`cascaded` re-chooses a follower as soon as its producer
        changes, without the heap: its :meth:`greedy` reads that producer's choice alone,
        final by then, and no equation it would have waited for in the heap reads its
        choice (a consumer of it comes later), so the cascade's choices are the heap's.
        614 of the 1,137 equations of Llama's adamw step are followers (most of its
        elementwise and shape ops: one variable input, or one value and literals): its
        search pops the heap 87,906 times where it popped it 168,092 times."""
        found: dict[str, list[str]] = {path: [] for path in self.paths}
        for path, producers in self.producers.items():
            if not producers or path in self.stacking:
                continue
            head = producers[0]
            position = self.position[path]
            if (
                any(producer != head for producer in producers) or head in self.stacking
                or self.position[head] >= position
                or any(p <= position for _, p in self.downstream[path])
            ):
                continue
            found[head].append(path)
        return {path: tuple(dict.fromkeys(paths)) for path, paths in found.items()}

    def _price(self, compiled: bool, overhead: Overhead, charged: bool = True) -> None:
        """Price moves as the backend compiles them (``compiled``) or by the planner alone,
        with ``overhead`` bytes per collective (one figure or one per planned kind) in the
        routes and, ``charged``, in the objective: the memos of everything priced, empty."""
        self.overhead = overhead  # bytes per collective the routes are chosen with (the model's collective_overhead)
        # and per planned kind, what the objective charges (none for walked_bytes())
        self.charged = {kind: overhead_of(overhead, kind) if charged else 0 for kind in COMMUNICATING}
        self.compiled = compiled  # priced as the backend compiles (else by the planner alone: _greedy_stack reads it)
        rules = _backend_rules(self.graph.mesh) if compiled else None
        # what a planned reduce-scatter costs in units of the planner's (in the moves and the look-ahead's pending
        # reductions, :func:`.select.pending_reduction`): 2 where the backend compiles it as an all-reduce
        self.reduction_scale = 2.0 if rules is not None and rules.compiled_kind(REDUCE_SCATTER) == ALL_REDUCE else 1.0
        # per element type, how many times its planned bytes the backend sends (CPU: bfloat16 in float32)
        self.widening: Callable[[np.dtype], int] = functools.cache(rules.widening) if rules is not None else _unwidened
        # priced as the planner prices (a second search by the planner's prices would find the same)
        self.as_planned = rules is None or (self.reduction_scale == 1.0 and not rules.widened)
        self._plain: _Search | None = None  # plain_bytes()' search, built once
        self._planned: _Search | None = None  # planned()'s, built once
        self._walked: _Search | None = None  # walked_bytes()' search, built once
        self.costs: dict[tuple[AvalKey, State, State], Cost] = {}
        self.charges: dict[tuple[ValueId, State], Cost] = {}
        self.pendings: dict[tuple[AvalKey, State, frozenset[int]], float] = {}
        self.pending_charges: dict[tuple[int, int, frozenset[int]], float] = {}  # pending() per node kind
        # input_costs() per node kind and arriving states (greedy(), cheapest() and cheapest_around() price
        # the same inputs into every candidate)
        self.input_cost_lists: dict[tuple[int, tuple[State, ...]], list[Cost]] = {}
        # and per node kind, input and arriving state: its moves into the distinct layouts candidates need
        self.need_costs: dict[tuple[int, int, State], list[Cost]] = {}
        # value_cost() per value: its deciders (the choices it reads) and its costs by their choices
        self.value_costs: list[tuple[Callable[[Choice], Any], dict[Any, Cost]]] = [
            (decide, {}) for decide in self.deciders
        ]
        self.totals: dict[Any, Cost] = {}  # total() per choice
        self.groupings: dict[Any, Any] = {}  # combined() per choice
        # and its moves per equation, candidate and arriving states
        self.node_moves: dict[tuple[str, int, tuple[State, ...]], tuple[RedistributePlan | None, ...]] = {}
        # moved_equations()' last choice and its rows per node
        self._rows: tuple[Choice, list[tuple[MovedEquation, ...]]] | None = None
        self._dataflow: Dataflow | None = None  # what grouping its rows reads that no choice changes, found once
        # greedy() per node and the choices it reads (greedy_reads: how its inputs not fixed arrive, and a
        # stacking node's consumers' needs): found before the arriving states are built (a memo by arriving
        # states too found 2% more on GPT-2's adamw step, for the cost of building and hashing them at every
        # miss); a stacking node's look-ahead, memoized so and by its arriving states and needs below, ran 349
        # times where it ran 5,876 times unmemoized (GPT-2's 2-layer adamw step)
        # with both tie-breaks' answers (see tie_moved()), found in one pass; per ``reducing``, per node by
        # position (a list index and a dict read per equation a cascade visits)
        self.greedy_by_reads: dict[tuple[bool, bool], list[dict[Any, tuple[int, int]]]] = {}
        # and per node kind and arriving states, and a stacking node's needs (a model's repeated layers meet the
        # same inputs: on the Llama adamw step 5,406 distinct of 18,545 misses of the memo by producers; on
        # GPT-2's 2-layer one 349 distinct of 657 look-aheads)
        self.greedy_by_arriving: dict[tuple[Any, ...], tuple[int, int]] = {}
        # evaluate() per move: (the equations its result depends on, their choices, the tie-break it holds for
        # (None: both), the result)
        self.evaluations: dict[Move, list[tuple[Callable[[Choice], Any], Any, bool | None, Evaluation]]] = {}
        self.alternative_moves: dict[tuple[str, Any], list[tuple[int, bool]]] = {}
        # and per kind (an equation making an output of the function: per path) and the states they depend on
        self.alternatives_by_states: dict[tuple[Any, ...], list[tuple[int, bool]]] = {}
        # pull_moves() per node, its carry_pulls and partly: (the getter of the choices they read, those choices, the
        # moves)
        self.pulls_by_reads: dict[tuple[str, bool, bool], list[tuple[Callable[[Choice], Any], Any, list[Any]]]] = {}
        self.fewest_moved = False  # greedy()'s tie-break (see tie_moved())

    def tie_moved(self, fewest: bool) -> None:
        """Break :meth:`greedy`'s cost ties by the fewest inputs moved (``fewest``) or by the
        candidates' order alone. That order ranks them for the inputs the walk saw, not for
        those a cascade gives: a tie broken by it takes what was cheapest there. A slice or
        a local partial costs nothing, but where it is not needed its consumers pay to undo
        it: the Megatron MLP step's gradient ``mul`` of a broadcast scalar and the loss's
        replicated activation (``R,R ; S(0),R``) took ``(dp,tp),None,None``, first for the
        walked ``S(0),P`` (reduce-scattered there), its matmul consumers all-gathered it
        back, and no descent reached XLA's plan (1.18x XLA's bytes, 10 all-reduces where XLA
        has 8 operands). Neither tie-break is better everywhere (by the fewest moved, that
        step and Llama's adamw step reach cheaper plans, GPT-2's and Equinox's adamw steps
        dearer ones): :func:`_select` descends with each. :meth:`greedy`'s memo holds both
        answers; :meth:`evaluate`'s keeps a cascade that met no tie the two break apart for both."""
        self.fewest_moved = fewest

    @functools.cached_property
    def layers(self) -> list[blocks.Block]:
        """The program's repeated layers (:mod:`.blocks`; empty where it has none)."""
        kinds = [self.kinds[path] for path in self.paths]
        return blocks.layer_blocks(blocks.find_blocks(kinds, blocks.graph_sources(self.graph)), len(self.graph.nodes))

    @property
    def walks_whole(self) -> bool:
        """Whether the descents that walk the whole program per move run (the common
        descents of :func:`_commoned` and :func:`_continued`, the regrouping): not on a
        program with repeated layers (:attr:`layers`, the seeded search), where they grow
        faster than the program and changed no prediction measured (their docstrings)."""
        return not self.layers

    def repriced(self, compiled: bool, overhead: Overhead | None = None, charged: bool = True) -> _Search:
        """The same graph's search priced otherwise (:meth:`_price`; ``overhead`` None: this
        search's): the tables that do not depend on prices (states, neighbours, memo keys)
        shared, built once per graph. One search per pricing, with its memos (each a function
        of the prices and the choices it read; its tie-break the candidates' order,
        :meth:`tie_moved`, which only :func:`_choose` changes, on its own search): under the
        default model :func:`_escaped`'s escape search and :func:`_continued`'s price alike,
        and so do :func:`_choose`'s planner-priced search and :meth:`planned` (the cold
        predict of Llama's 2x4 adamw step 1.95 -> 1.83 s CPU, GPT-2's 1.59 -> 1.51)."""
        key = (compiled, self.overhead if overhead is None else overhead, charged)
        other = self.repricings.get(key)
        if other is None:
            other = self.repricings[key] = copy.copy(self)
            other._price(*key)
        return other

    # -- costs ------------------------------------------------------------------------------

    def cost(self, aval: AvalKey, src: State, dst: State) -> Cost:
        if src == dst:
            return _ZERO
        key = (aval, src, dst)
        cost = self.costs.get(key)
        if cost is None:
            # the plan's steps in exact integers over one scale (their floats as their Fractions')
            collectives, scale = plan_priced(aval[0], aval[1], src, dst, self.mesh_shape, self.weights, self.overhead)
            if self.reduction_scale == 1.0:
                nbytes = sum(c for _, c in collectives) / scale
            else:  # as the backend compiles the plan: its reduce-scatters as all-reduces
                nbytes = sum(c / scale * (self.reduction_scale if kind == REDUCE_SCATTER else 1.0) for kind, c in collectives)
            charged = self.charged
            cost = self.costs[key] = (
                self.widening(aval[1]) * nbytes + sum(charged[kind] for kind, _ in collectives),
                float(len(collectives)),
            )
        return cost

    def walked_bytes(self, choice: Choice) -> float:
        """The bytes of a choice as this search routes its moves (with the overhead), the
        overhead not charged: where every kind is charged one figure, the objective less it
        times the collectives (exact); else by a search repriced without the charge, built
        once (a second pricing of every move: kept off the default model's cold predict)."""
        charges = set(self.charged.values())
        if len(charges) == 1:
            cost = self.total(choice)
            return cost[0] - charges.pop() * cost[1]
        if self._walked is None:
            self._walked = self.repriced(self.compiled, charged=False)
        return self._walked.total(choice)[0]

    def planned(self) -> _Search:
        """This search priced by the planner's prices: itself where it prices so
        (:attr:`as_planned`), else its repricing, built once (the bound of every result,
        :func:`_bounded`, prices by it: the escape and common descents' bounds shared it)."""
        if self.as_planned:
            return self
        if self._planned is None:
            self._planned = self.repriced(compiled=False)
        return self._planned

    def plain_bytes(self, choice: Choice) -> float:
        """The bytes of a choice by the planner's prices and routes without the overhead
        (what ``predict(search="eager")`` reports for eager dispatch's choice)."""
        if self._plain is None:
            self._plain = self.repriced(compiled=False, overhead=0)
        return self._plain.total(choice)[0]

    def grouped(self, choice: Choice) -> Cost:
        """The objective with each collective XLA's combiner merges into another charged
        no overhead (a group of n pays its kind's once, not n times), and the collectives
        after the combiner: the latency the compiled program pays, where :meth:`total`
        charges every planned collective (the descents need a sum over values; this walks
        the whole choice, :meth:`combined`, so it ranks a few finished results only)."""
        total = self.total(choice)
        combined = self.combined(choice)
        if combined is None:  # no combiner rules for the platform: every planned collective its own
            return total
        groups = combined[1]
        # a group of several is a kind the backend combines (never a halo's collective-permute, not charged)
        merged = sum((len(group.members) - 1) * self.charged[group.kind] for group in groups if len(group.members) > 1)
        return total[0] - merged, float(len(groups))

    def combined(
        self, choice: Choice
    ) -> tuple[tuple[PlannedCollective, ...], tuple[CombinedCollective, ...]] | None:
        """``choice``'s planned collectives (:func:`.combine.planned_collectives`: the moves
        routed as this search routes them, and at the end the outputs' moves to their fixed
        layouts and a free output's partials reduced, as :func:`.check.check` converts it
        to XLA's layout and :meth:`charge` charges it) and how XLA's combiner groups them
        (:func:`.combine.combine`); None on a platform without rules."""
        key = self.everything(choice)
        if key not in self.groupings:
            self.groupings[key] = self._combined(choice)
        return self.groupings[key]

    def _combined(
        self, choice: Choice
    ) -> tuple[tuple[PlannedCollective, ...], tuple[CombinedCollective, ...]] | None:
        rules = _backend_rules(self.graph.mesh)
        if rules is None:
            return None
        layouts = self.layouts
        ends = []
        for value, targets in self.owed.items():
            (shape, dtype), state = self.out_avals[value[0]][value[1]], self.outs[value[0]][choice[value[0]]][value[1]]
            for target in targets:  # a free output's partials reduced (check converts it so to XLA's layout)
                target = self.states[layouts[state].without_partial()] if target is None else target
                ends += [(value, self.plan(shape, dtype, state, target))] if target != state else []
        equations = self.moved_equations(choice)
        if self._dataflow is None:  # the rows' paths and sources are the graph's, whatever the choice
            self._dataflow = Dataflow(equations, self.loops, dict(self.graph.returned),
                                      self.graph.outputs, self.graph.results)
        planned = planned_collectives(equations, rules, ends, dataflow=self._dataflow)
        return planned, combine(planned, rules)

    def plan(self, shape: tuple[int, ...], dtype: Any, src: State, dst: State) -> RedistributePlan | None:
        """The planner's plan of a move as this search routes it (None: no move)."""
        return None if src == dst else cached_plan(
            shape, dtype, self.layouts[src], self.layouts[dst], self.cost_model, self.overhead
        )

    def moved_equations(self, choice: Choice) -> list[MovedEquation]:
        """``choice``'s equations as :func:`.combine.planned_collectives` reads them (each
        with its inputs' moves), in program order: per node, the rows :meth:`_rows_at` makes
        at its position. Rebuilt only at the positions where ``choice`` differs from the
        last choice built (its changed equations, their consumers, the scans of one trip
        they open): :meth:`regrouped`'s trials each change a few of GPT-2's adamw step's
        ~950 equations, and rebuilding every row was ~40% of a grouping."""
        if self._rows is None:
            positions: Iterable[int] = range(len(self.paths))
            rows: list[tuple[MovedEquation, ...]] = [()] * len(self.paths)
        else:
            last, rows = self._rows
            rows = list(rows)
            changed = [p for p, path in enumerate(self.paths) if choice[path] != last[path]]
            found = set(changed)
            for p in changed:
                found.update(q for _, q in self.downstream[self.paths[p]])
            positions = found | {self.opened_at[p] for p in found if p in self.opened_at}
        for p in positions:
            rows[p] = self._rows_at(p, choice)
        self._rows = (dict(choice), rows)
        return [row for at in rows for row in at]

    def _rows_at(self, position: int, choice: Choice) -> tuple[MovedEquation, ...]:
        """The rows :meth:`moved_equations` makes at node ``position``: the opening of each
        scan of one trip whose body begins there (XLA inlines it: its initial values move to
        the carries there, the node, listed after its body, keeps the body's results'
        moves), then the moves of a loop body's results to its carries (a cond branch's to
        its join), which run in that body as the walk's carry and join rows do, then the
        node's own."""
        graph = self.graph
        loops, inlined = self.loops, self.inlined

        def in_body(loop: str, src: ValueId | None) -> bool:
            return src is not None and src[0].startswith(loop + ".")

        rows = []
        for scan in self.openings.get(position, ()):
            starting = tuple(not in_body(scan.path, src) for src in scan.sources)
            rows.append(MovedEquation(
                scan.path, tuple(src if keep else None for src, keep in zip(scan.sources, starting)),
                tuple(p if keep else None for p, keep in zip(self.node_plans(scan, choice), starting)),
            ))
        node = graph.nodes[position]
        plans = list(self.node_plans(node, choice))
        if node.path in loops or node.path in inlined:
            for i, src in enumerate(node.sources):
                if in_body(node.path, src):  # a scan's named as the walk's carry rows (its sources: its initial
                    # values, then its body's results), the roots of its body's post order (ProgramGraph.results)
                    name = f"{node.path}.carry{i - len(node.sources) // 2}" if (
                        node.path in inlined or loops.get(node.path) == "scan") else f"{src[0]}.out{i}"
                    rows.append(MovedEquation(name, (src,), (plans[i],)))
                if in_body(node.path, src) or node.path in inlined:
                    plans[i] = None
        rows.append(MovedEquation(node.path, node.sources, tuple(plans), False, node.region))
        return tuple(rows)

    def node_plans(self, node: ProgramNode, choice: Choice) -> tuple[RedistributePlan | None, ...]:
        """The moves of ``node``'s inputs into its chosen candidate's layouts, as they arrive
        (per equation, candidate and arriving states: the choices grouped differ in a few)."""
        key = (node.path, choice[node.path], self.arriving(node.path, choice))
        known = self.node_moves.get(key)
        if known is None:
            needs = self.ins[node.path][key[1]]
            known = self.node_moves[key] = tuple(
                self.plan(spec.shape, spec.dtype, arriving, need)
                for spec, arriving, need in zip(node.inputs, key[2], needs)
            )
        return known

    def charge(self, value: ValueId, aval: AvalKey, state: State) -> Cost:
        """What an output of the function still owes in layout ``state``: the move to its
        fixed layout, or for a free output to the layout its caller takes it in
        (``taken``)."""
        if value not in self.owed:
            return _ZERO
        key = (value, state)
        cost = self.charges.get(key)
        if cost is None:
            nbytes, steps = 0.0, 0.0
            for target in self.owed[value]:
                owed = self.cost(aval, state, self.taken[value] if target is None else target)
                nbytes, steps = nbytes + owed[0], steps + owed[1]
            cost = self.charges[key] = (nbytes, steps)
        return cost

    def arriving(self, path: str, choice: Choice) -> tuple[State, ...]:
        """The layouts the inputs of equation ``path`` arrive in (:meth:`state_of` of each)."""
        outs = self.outs
        # a list comprehension, not a generator: 0.6x its time for the ~2 inputs of an equation (~27k calls in a
        # cold predict of Llama's 2-layer adamw step)
        return tuple([fixed or outs[src][choice[src]][j] for fixed, src, j in self.arrivals[path]])

    def state_of(self, path: str, i: int, choice: Choice) -> State:
        """The layout input ``i`` of equation ``path`` arrives in, its producer as chosen."""
        fixed = self.fixed[path][i]
        if fixed is not None:
            return fixed
        src_path, j = self.sources[path][i]  # type: ignore[misc]
        return self.outs[src_path][choice[src_path]][j]

    # -- cascading moves ---------------------------------------------------------------------

    def greedy(self, path: str, choice: Choice, reducing: bool = False) -> int:
        """Eager dispatch's choice for equation ``path`` given its inputs as they arrive:
        no redistribution first, then the least input cost plus pending new partials (with
        :attr:`fewest_moved`, then the fewest inputs moved), then the first."""
        return self.greedy_pair(path, choice, reducing)[self.fewest_moved]

    def greedy_pair(self, path: str, choice: Choice, reducing: bool = False) -> tuple[int, int]:
        """:meth:`greedy`'s answers with ties broken by the candidates' order and by the
        fewest inputs moved (one pass: the two differ only among candidates of equal cost)."""
        memo = self.greedy_memos(reducing)[self.position[path]]
        by_reads = self.greedy_choices[path](choice)
        known = memo.get(by_reads)
        if known is not None:
            return known
        return self.greedy_found(path, choice, reducing, memo, by_reads)

    def greedy_found(
        self, path: str, choice: Choice, reducing: bool, memo: dict[Any, tuple[int, int]], by_reads: Any,
        ahead: bool = False,
    ) -> tuple[int, int]:
        """:meth:`greedy_pair` where its memo ``memo`` has no answer for the choices it reads
        (``by_reads``): found by the arriving states, stored there (:meth:`cascaded` reads
        the memo inline and calls this on a miss, not reading it twice). ``ahead``: an
        equation near the fixed outputs receiving a partial looks ahead to the layouts they
        keep (:meth:`_greedy_kept`)."""
        arriving = self.arriving(path, choice)
        needs: tuple[State, ...] | None = None
        by_arriving: tuple[Any, ...] = (self.kinds[path], arriving, reducing)
        if path in self.stacking:  # its look-ahead reads its consumers' needs too
            needs = self.needs((path, 0), choice)
            by_arriving += (needs,)
        kept = self.kept_ahead.get(path) if ahead and needs is None and _partial_dims(arriving) else None
        if kept is not None:  # a kind's equations differ in the outputs near them
            by_arriving += (kept,)
        pair = self.greedy_by_arriving.get(by_arriving)
        if pair is None:
            pair = self.greedy_by_arriving[by_arriving] = (
                self._greedy_stack(path, arriving, needs, reducing) if needs is not None
                else self._greedy(path, arriving, reducing) if kept is None
                else self._greedy_kept(path, arriving, kept, reducing)
            )
        memo[by_reads] = pair
        return pair

    def greedy_memos(self, reducing: bool, ahead: bool = False) -> list[dict[Any, tuple[int, int]]]:
        """:meth:`greedy`'s memo by the choices it reads (:attr:`greedy_reads`), per node by position (created
        once), per ``reducing`` and ``ahead`` (:meth:`greedy_found`)."""
        memos = self.greedy_by_reads.get((reducing, ahead))
        if memos is None:
            memos = self.greedy_by_reads[reducing, ahead] = [{} for _ in self.paths]
        return memos

    def _greedy(self, path: str, arriving: tuple[State, ...], reducing: bool) -> tuple[int, int]:
        given = frozenset() if reducing else _partial_dims(arriving)
        exact = self.candidates[path].by_ins.get(arriving)
        if exact:  # no plan to cost, no input moved
            best = min(exact, key=lambda k: (self.pending(path, k, given), k))
            return best, best
        return self._first_and_fewest(path, arriving, self.input_costs(path, arriving), given)

    def _first_and_fewest(
        self, path: str, arriving: tuple[State, ...], costs: Iterable[tuple[Any, int]], given: frozenset[int]
    ) -> tuple[int, int]:
        """The candidates of ``path`` first by ``costs`` (per candidate, its bytes and steps)
        plus its pending reductions (``given``: the partial mesh dims arriving), and among
        the equally cheap the one moving the fewest of the ``arriving`` inputs: both
        tie-breaks of :meth:`tie_moved` in one pass."""
        first, first_key, fewest, fewest_key, ins = 0, None, 0, None, self.ins[path]
        for k, (nbytes, steps) in enumerate(costs):
            if first_key is not None and nbytes > first_key[0]:
                continue  # pending charges are >= 0: it cannot come first
            key = (nbytes + self.pending(path, k, given), steps)
            if first_key is None or key < first_key:
                first, first_key = k, key
            if first_key == key:  # the least cost (so far): by the fewest moved among those
                moved = (*key, sum(map(ne, arriving, ins[k])))
                if fewest_key is None or moved < fewest_key:
                    fewest, fewest_key = k, moved
        return first, fewest

    def _greedy_kept(
        self, path: str, arriving: tuple[State, ...], kept: tuple[tuple[int, tuple[State, ...]], ...], reducing: bool
    ) -> tuple[int, int]:
        """:meth:`_greedy` of an equation near the function's fixed outputs receiving a
        partial, in a strict value move's cascade (:meth:`cascaded`' ``ahead``): each
        candidate also charged the move of each output ``kept`` names (:attr:`kept_ahead`)
        into the cheapest layout a fixed output of its aval keeps (:attr:`kept_states`), as
        the update of that parameter will need it. Eager dispatch's rule reduce-scatters a
        bias gradient partial over ``dp`` (a reduce-scatter is cheaper than an all-reduce)
        and the update then runs split and all-gathers the parameter and both Adam moments
        back at the outputs, which it never prices: tests/models/cnn.py's one-conv step,
        the logits' gradient taken as it comes by the bias and flat gradients (a strict
        value move to its own layout), cascaded so to 72,248 by the search's objective (the
        latency-bound default's, 12 planned collectives) where, reduced into the bias's
        replicated layout, to XLA's plan (22,956 in 6; 22,188 after XLA's combiner). Both
        tie-breaks as :meth:`_greedy`'s."""
        avals, outs = self.out_avals[path], self.outs[path]

        def with_kept_moves() -> Iterator[tuple[Any, int]]:
            for k, (nbytes, steps) in enumerate(self.input_costs(path, arriving)):
                for j, states in kept:
                    move = min(self.cost(avals[j], outs[k][j], state) for state in states)
                    nbytes, steps = nbytes + move[0], steps + move[1]
                yield nbytes, steps

        given = frozenset() if reducing else _partial_dims(arriving)
        return self._first_and_fewest(path, arriving, with_kept_moves(), given)

    def _greedy_stack(
        self, path: str, arriving: tuple[State, ...], needs: tuple[State, ...], reducing: bool
    ) -> tuple[int, int]:
        """:meth:`greedy` of a node stacking a loop body's value (:attr:`ProgramNode.stacks`):
        the least input cost plus pending new partials plus the moves of the stack into the
        layouts its consumers now need (ties: the first; both tie-breaks alike). Eager
        dispatch's rule, stacking the value as it comes, leaves its move to the consumers
        after the loop, the loop's length times the slice's move inside the body (counted
        once, as compiled). The descents of GPT-2's adamw step (layers under ``lax.scan``)
        then removed those moves first, the more so the deeper, into other basins: 1.27x
        XLA's bytes at 8 layers (41,770 B -> 56,938 B from 2 to 8 layers, XLA's 44,942 B at
        every depth), where the 2-layer plan would have cost 0.78x the found plan's
        objective. With the look-ahead the descents find that plan at every depth.

        In the search priced by the planner alone (``compiled=False``: :func:`_select`'s
        second, on CPU), a stack arriving partial is stacked in the split it arrives in
        (eager dispatch's), the look-ahead deciding its partials only (reduced in the body,
        once, or not). The needs it reads are its consumers' current choices, which the
        cascade re-chooses next, and a Replicate stack meets every need for free: on
        GPT-2's 4-layer adamw step over a 4x2 ``dp, tp`` mesh at Megatron's plan, the
        planner's descent re-chose the partial stacks of the layers' gradients (``P,S(0)``,
        ``S(0),P``, ``P,P``) as ``R,R``, reducing and gathering in the body (a bias's priced
        544 there and nothing after the loop, where reducing alone is 288 and 448 after), to
        meet needs such as ``S(0),S(1)`` (the stacked layer dim split over ``dp``, as the walk
        laid out the optimizer's update) and ``P,P``; the update then kept the layer dim split, with all-to-alls
        into it and the parameters and both moments gathered back into their layouts at the
        outputs, which the look-ahead never priced: 110,314 B predicted (2 / 8 layers:
        85,066 / 169,642 B; XLA's jit 62,786 B at 4). So restricted: 47,626 / 48,138 /
        48,138 B at 2 / 4 / 8 layers (as CPU compiles it 51,210 / 51,722 / 51,722 B, pinned
        51,728 B; at 2 layers 48,522 B since uneven all-to-alls are priced padded,
        docs/autoplan.md), GPT-2 on ``(8,)`` and on 2x4 as before (84,903 and 41,770 B at 2, 4 and 8
        layers). Restricted as compiled too, the 2x4 step went 41,770 -> 43,722 / 43,722 /
        43,850 B; restricted in the planner's search for every stack, not only those
        arriving partial, the 2x4 step at 2 layers became another 41,770 B program that
        XLA's combiner compiles pinned with one all-reduce more.

        A function of the node's kind, its arriving states and its consumers' needs (in
        order: their sum's), it is memoized as every node's :meth:`greedy` is
        (:meth:`greedy_pair`): by the choices it reads, then by those. Unmemoized it was
        GPT-2's own cost, Llama's unrolled layers having no stacks: on its 2-layer adamw
        step (dp=2 x tp=4, Megatron's plan) 5,876 look-aheads, ~0.5 of the ~2.5 s of a
        profiled cold predict; memoized, 349 (4.52 -> 3.72 million Python calls; at 8 layers
        4.28 -> 3.57 million), the same choices, and a cold predict took 0.88 of its time
        at 2 layers, 0.90 at 8 (paired medians of 8 rounds alternated in one process, load
        ~2.5; Llama's adamw step unchanged: the same calls)."""
        given = frozenset() if reducing else _partial_dims(arriving)
        aval = self.out_avals[path][0]
        costs = self.input_costs(path, arriving)
        ks: Sequence[int] = range(len(costs))
        if not self.compiled and _partial_dims(arriving):
            split = self.outs[path][self._greedy(path, arriving, reducing)[0]][0][0]  # eager dispatch's split
            ks = [k for k in ks if self.outs[path][k][0][0] == split]
        best, best_key = 0, None
        for k in ks:
            nbytes, steps = costs[k]
            moves = [self.cost(aval, self.outs[path][k][0], need) for need in needs]
            key = (nbytes + self.pending(path, k, given) + sum(m[0] for m in moves), steps + sum(m[1] for m in moves))
            if best_key is None or key < best_key:
                best, best_key = k, key
        return best, best

    def pending(self, path: str, k: int, given: frozenset[int]) -> float:
        """Eager dispatch's look-ahead charge for the partials candidate ``k`` makes."""
        key = (self.kinds[path], k, given)
        known = self.pending_charges.get(key)
        if known is None:
            known = self.pending_charges[key] = self._pending(path, k, given)
        return known

    def _pending(self, path: str, k: int, given: frozenset[int]) -> float:
        total = 0.0
        for aval, state in zip(self.out_avals[path], self.outs[path][k]):
            made = frozenset(m for m, op in enumerate(state[1]) if op) - given
            if not made:
                continue
            key = (aval, state, made)
            value = self.pendings.get(key)
            if value is None:
                value = self.pendings[key] = self.reduction_scale * self.widening(aval[1]) * float(
                    pending_reduction((Aval(*aval),), (self.layouts[state],), set(given), self.cost_model)
                )
            total += value
        return total

    def cascaded(
        self, seeds: dict[str, int], trial: Choice, follow: bool = True, reducing: bool = False,
        fewest_moved: bool | None = None, keeping: bool = False, ahead: bool = False,
    ) -> tuple[dict[str, int], dict[str, int], frozenset[int], bool, bool]:
        """Equations ``seeds`` running the given candidates (path -> candidate) and
        (``follow``) every equation downstream whose inputs change re-chosen as eager
        dispatch would, until the changes die out, made in ``trial`` (the choice itself,
        changed in place: a copy of the whole choice per evaluation costs more; an exception
        ends the search, which owns the choice). Returns the changes (path -> candidate), the
        candidates they replaced (``kept``: the caller changes ``trial`` back with them), the
        equations re-chosen or looked at, by position (the result depends on their choices and their
        producers', and on the neighbours of those changed, :attr:`neighbours`), and whether
        some re-choice met a tie the two tie-breaks (:meth:`tie_moved`) break apart
        (``fewest_moved``: that tie-break instead of the descent's), and whether some equation
        kept its candidate. ``keeping``: an equation
        whose changed inputs now arrive as its candidate takes them keeps it (:meth:`keeps`)
        instead of being re-chosen (where none does, the cascade is the one without
        ``keeping``). ``ahead``: an equation near the fixed outputs receiving a
        partial re-chosen looking ahead to the layouts they keep (:meth:`_greedy_kept`).
        :meth:`evaluate` prices the changes before changing it back (:meth:`delta`)."""
        kept = {path: trial[path] for path in seeds}
        trial.update(seeds)
        changes = dict(seeds)
        # every equation queued is looked at once (``seen``: a loop body's read of its carry, a back edge, is
        # followed once), in program order; a seed is never queued (a seed downstream of another keeps its
        # candidate: a value move's); the equations looked at are those seen
        queue = sorted({p for path in seeds if follow for c, p in self.downstream[path] if c not in seeds})  # a heap
        seen = {*queue, *map(self.position.__getitem__, seeds)}
        # the hot loop of the search: greedy()'s memo read inline, locals for the tables it reads
        steps, memos, pop, push = self.steps, self.greedy_memos(reducing, ahead), heapq.heappop, heapq.heappush
        fewest, tied, held = self.fewest_moved if fewest_moved is None else fewest_moved, False, False
        while queue:
            run = [pop(queue)]  # the equation first in program order, then its followers' chains
            while run:
                position = run.pop()
                path, producers, consumers, followers = steps[position]
                if keeping and self.keeps(path, trial, kept):
                    held = True
                    continue
                memo = memos[position]
                pair = memo.get(reads := producers(trial))
                if pair is None:
                    pair = self.greedy_found(path, trial, reducing, memo, reads, ahead)
                best = pair[fewest]
                if pair[0] != pair[1]:
                    tied = True
                was = trial[path]
                if best == was:
                    continue
                kept[path] = was  # each equation is looked at once: its candidate before the cascade
                trial[path] = changes[path] = best
                for position in consumers:
                    if position not in seen:
                        seen.add(position)
                        push(queue, position)
                for position in followers:
                    if position not in seen:
                        seen.add(position)
                        run.append(position)
        return changes, kept, frozenset(seen), tied, held

    def keeps(self, path: str, trial: Choice, kept: dict[str, int]) -> bool:
        """Whether equation ``path`` keeps its candidate in a *keeping* cascade
        (:meth:`cascaded`' ``keeping``): every input whose producer the cascade changed
        (``kept``: their candidates before it) now arrives in the layout that candidate
        takes it in, so the change removed its move there and re-choosing it would only
        move its outputs on. Eager dispatch's re-choice (:meth:`greedy`) takes the
        candidate cheapest for its inputs with the least pending reduction, whatever it
        had: Equinox's backward layer scan (tests/models/eqx_scan.py) re-chosen to carry
        its activation gradient reduced over ``tp`` (the initial value all-reduced before
        the loop, where the embedding's gradient had all-reduced it after: the same bytes)
        gives the embedding's ``scatter-add`` its updates as it takes them, but re-chosen
        it makes the gradient split over ``tp`` (a reduce-scatter owes less than an
        all-reduce), and the update then gathers the table and both Adam moments back at
        the outputs (+64,128 under the AG/A2A 8,192 model); kept, the move lowers the
        objective by 384 (the down projection's bias gradient, formed from the carry,
        partial over ``dp`` only) and the norm's two gradients join the carry's all-reduce
        at the body's end: 8 -> 7 collectives after XLA's combiner, XLA's count
        (docs/inference.md section 6)."""
        needs, outs, fitted = self.ins[path][trial[path]], self.outs, False
        for i, (fixed, src, j) in enumerate(self.arrivals[path]):
            if fixed is None and src in kept:
                now = outs[src][trial[src]][j]
                if now != outs[src][kept[src]][j]:
                    if now != needs[i]:
                        return False
                    fitted = True
        return fitted

    def around(self, values: Collection[int], choice: Choice) -> Cost:
        """The cost of ``values`` (by id, :meth:`touched_by`; outputs' charges among them) at
        ``choice``, summed in their order (:meth:`value_cost`)."""
        nbytes, steps = 0.0, 0.0
        tables, value_cost = self.value_costs, self.value_cost
        for value in values:
            decide, memo = tables[value]
            cost = memo.get(decide(choice)) or value_cost(value, choice)
            nbytes, steps = nbytes + cost[0], steps + cost[1]
        return nbytes, steps

    def touched_by(self, paths: Sequence[str]) -> Collection[int]:
        """Every value (by id) ``paths`` produce or consume, each once."""
        if len(paths) == 1:
            return self.touched[paths[0]]
        return set().union(*map(self.touched.__getitem__, paths))

    def value_cost(self, value_id: int, choice: Choice) -> Cost:
        """The redistributions of one value (by id): one per distinct layout its consumers
        need, per computation their moves run in but one seeing another's
        (:func:`.combine.move_computations`: a compiled program computes a shared one
        once there); or an output's charge."""
        decide, memo = self.value_costs[value_id]
        key = decide(choice)
        known = memo.get(key)
        if known is not None:
            return known
        value = self.priced[value_id]
        if value[0] == "owed":  # an output of the function: what it still owes in its producer's layout
            _, path, j = value
            known = memo[key] = self.charge((path, j), self.out_avals[path][j], self.outs[path][choice[path]][j])
            return known
        if value[0] == "literal":
            _, path, i = value
            known = memo[key] = self.cost(self.in_avals[path][i], self.fixed[path][i], self.ins[path][choice[path]][i])
            return known
        # an edge's value: its state as given or made, moved into each layout its consumers need (needs() and cost()
        # inlined, a need met as it comes skipped, its move free: the descents price ~20k values so on Llama's
        # 2-layer adamw step, ~15k of them needed as they come by some consumer)
        aval, fixed, readers = self.readers[value_id]
        state = fixed or self.outs[value[0]][choice[value[0]]][value[1]]
        costs, cost = self.costs, self.cost
        if len(readers) == 1:  # one consumer (most values): its move alone, the memo's own cost (no sum)
            ins, c, i, _ = readers[0]
            need = ins[choice[c]][i]
            known = memo[key] = _ZERO if need == state else costs.get((aval, state, need)) or cost(aval, state, need)
            return known
        moves: dict[State, dict[str, tuple[str, ...]]] = {}  # per layout needed, where its moves run
        for ins, c, i, within in readers:
            need = ins[choice[c]][i]
            if need != state:
                moves.setdefault(need, {}).setdefault(within[0], within)
        nbytes, steps = 0.0, 0.0
        for need, runs in moves.items():
            move = costs.get((aval, state, need)) or cost(aval, state, need)
            n = sum(not any(where in runs for where in within[1:]) for within in runs.values())
            nbytes, steps = nbytes + n * move[0], steps + n * move[1]
        known = memo[key] = (nbytes, steps)
        return known

    def alternatives(self, path: str, choice: Choice, shared: bool = False) -> list[tuple[int, bool]]:
        """Moves worth a cascade. At an equation that makes, carries or receives partials:
        reducing them right there, into a split (the cheapest candidate without partial
        outputs) or to Replicate on those mesh dims (the cheapest that also splits
        nothing there). At an equation whose inputs are redistributed: the candidate
        cheapest for its inputs, whatever partials it makes (eager dispatch's look-ahead
        may have paid to avoid one, e.g. gathering a batch-split activation rather than
        making a weight gradient partial over the batch axis), and the candidate cheapest
        for its inputs and outputs together (:meth:`cheapest_around`), not cascading: the
        cheapest for its inputs alone ties on many (Equinox's embedding gradient took a
        masked scatter split on the embedding dim, all-gathered back). ``shared`` (the
        finishing descent): also the candidate cheapest for its inputs where an input that
        another consumer of its value already needs in that layout is free
        (:meth:`shared_needs`), cascading: a weight gradient reading the normed
        activation as the forward matmuls already gathered it, partial over ``dp`` and split
        as its parameter over ``tp`` (Llama's adamw step had taken the cheapest for its inputs
        alone, gathering over ``dp``: the gradient split on the transposed dims, the
        parameter and both Adam moments moved to that layout by an all-to-all each and back
        by an all-gather and an all-to-all each)."""
        key = (path, self.local_deciders[path](choice), (self.sharers[path](choice),) if shared else None)
        known = self.alternative_moves.get(key)
        if known is None:
            known = self.alternative_moves[key] = self._alternatives(path, choice, shared)
        return known

    def _alternatives(self, path: str, choice: Choice, shared: bool) -> list[tuple[int, bool]]:
        """:meth:`alternatives` by the states they depend on: the equation's candidate, the
        layouts its inputs arrive in, those its outputs' consumers need (and with ``shared``
        its inputs' other consumers): equations of one kind (candidates and avals, a model's
        repeated layers) meeting the same states have the same moves (by the memo of
        :meth:`alternatives`, by choices, Llama's 2-layer adamw step found 6,740 anew, 4,393
        of them states met before). An equation making an output of the function is kept
        apart (:meth:`charge` prices its outputs)."""
        k, arriving = choice[path], self.arriving(path, choice)
        needs = tuple(self.needs((path, j), choice) for j in range(len(self.out_avals[path])))
        free = self.shared_needs(path, choice) if shared else None
        key = (path if path in self.owing else self.kinds[path], k, arriving, needs, free)
        known = self.alternatives_by_states.get(key)
        if known is None:
            known = self.alternatives_by_states[key] = self._moves(path, k, arriving, needs, free)
        return known

    def _moves(
        self, path: str, k: int, arriving: tuple[State, ...], needs: tuple[tuple[State, ...], ...],
        free: tuple[frozenset[State], ...] | None,
    ) -> list[tuple[int, bool]]:
        """:meth:`alternatives` of ``path`` running candidate ``k`` with inputs ``arriving``,
        its outputs' consumers needing ``needs`` (per output, each layout once) and ``free``
        (:meth:`shared_needs`; None: no shared-input move)."""
        groups: list[tuple[Sequence[int], bool]] = []
        current = self.outs[path][k]
        partial = _partial_dims(current + arriving)
        if partial:
            table = self.candidates[path]
            scatter = table.unreduced
            groups += [(scatter, True), ([k for k in scatter if table.split_dims[k].isdisjoint(partial)], True)]
            if len(partial) > 1:  # reducing one mesh dim's partial, keeping the others' (e.g. tp, not dp)
                for m in sorted(partial):
                    groups.append((table.unreduced_on[m], True))
        around: list[tuple[Sequence[int], bool]] = []
        if self.redistributes(path, k, arriving):
            everything = range(len(self.ins[path]))
            groups += [(everything, True), (everything, False)]  # without cascading: its consumers redistribute
            around.append((everything, False))
        moves: list[tuple[int, bool]] = []
        for group, follow in around:  # the cheapest for its inputs and its outputs, its consumers as chosen
            best = self.cheapest_around(path, group, arriving, needs)
            if best != k:
                moves.append((best, follow))
        cheapest: dict[int, int] = {}  # per group (by identity: every candidate is a group twice)
        for group, follow in groups:
            if group:
                best = cheapest.get(id(group))
                if best is None:
                    best = cheapest[id(group)] = self.cheapest(path, group, arriving)
                if best != k and (best, follow) not in moves:
                    moves.append((best, follow))
        if around and free is not None:
            best = self.cheapest(path, range(len(self.ins[path])), arriving, free)
            if best != k and (best, True) not in moves:
                moves.append((best, True))
        return moves

    def needs(self, value: ValueId, choice: Choice) -> tuple[State, ...]:
        """The layouts the consumers of ``value`` need it in at ``choice``, each once, in
        their order (a compiled program makes each once; sums over them keep that order)."""
        return tuple(dict.fromkeys([self.ins[c][choice[c]][i] for c, i in self.consumers.get(value, ())]))

    def shared_needs(self, path: str, choice: Choice) -> tuple[frozenset[State], ...]:
        """Per input of ``path``, the layouts other consumers of its value need it in where
        its move sees theirs or theirs its (:func:`.combine.move_computations`): free in
        :meth:`input_costs` (a compiled program redistributes it once for all of them)."""
        within = self.within
        return tuple(
            frozenset(self.ins[c][choice[c]][i] for c, i in self.consumers[source] if c != path and (
                within[c, source][0] in within[path, source] or within[path, source][0] in within[c, source]))
            if source is not None else frozenset()
            for source in self.sources[path]
        )

    def every_candidate(self, path: str, choice: Choice) -> list[int]:
        """Every other candidate of an equation a value it makes or reads costs something at
        (``choice``), each a move alone (not cascading): the polish's (:func:`_polished`).
        :meth:`alternatives` offers moves only where an input is redistributed or partials
        are made, carried or received, and a cascade re-chooses each equation after the
        move as eager dispatch would; neither reaches an equation whose own output its
        consumer moves, re-chosen to make it as they take it. The chunked cross-entropy's
        gradient under ``lax.scan`` (tests/test_inference_program.py) broadcast the
        softmax's denominator split on the tokens as its forward pass had reduce-scattered
        it, and the product with the vocabulary-split probabilities moved it by an
        all-to-all; re-chosen alone to take its input gathered, the default model's
        objective 18,848 -> 18,680 and the program 928 -> 760 B (XLA's 736). The equations
        where nothing costs are left out: a move alone there changes only values that cost
        nothing, and one raising them is never applied (on Llama's 2-layer adamw step 3,802
        evaluations where 38,154, 0.09 s CPU where 0.46, the same result)."""
        values, value_cost = self.touched[path], self.value_cost
        if all(value_cost(value, choice) == _ZERO for value in values):
            return []
        current = choice[path]
        return [k for k in range(len(self.ins[path])) if k != current]

    def reducing_moves(self, path: str, choice: Choice) -> list[int]:
        """Reducing cascades at an equation that makes or receives partials: the
        candidates of :meth:`alternatives` reducing them there (and the current one),
        cascading with every equation downstream re-chosen as eager dispatch would if
        it charged the partials it continues too (:meth:`greedy` with ``reducing``):
        they reduce partials where they meet them instead of carrying them."""
        arriving = self.arriving(path, choice)
        current = self.outs[path][choice[path]]
        if not any(op for state in current + arriving for op in state[1]):
            return []
        return [choice[path]] + [k for k, follow in self.alternatives(path, choice) if follow]

    def value_moves(
        self, value: ValueId, choice: Choice, gathers: bool = False, common: bool = False, taken: bool = False,
    ) -> list[tuple[tuple[tuple[str, int], ...], bool]]:
        """Moves re-choosing every consumer of ``value`` at once, so that all of them take
        it in one layout: one its consumers already need, or its own with its partials
        reduced to Replicate (one all-reduce shared by every consumer, where each
        consumer alone would rather reduce-scatter: e.g. a weight gradient feeding the
        clip, both Adam moments and the update, whose outputs must come back unsplit).
        ``gathers`` (a last descent after the finishing one, from its result): a split value without partials, its own
        gathered to Replicate (that layout only, and only cascading: :meth:`improve`), when
        one of its consumers is at most ``_NEAR_OUTPUT`` equations upstream of an output with
        a fixed layout (an optimizer's update of a parameter); a strided split too (its
        gather costs a plain one's bytes). Each consumer takes it as below, and also (a
        *strict* move, taken only if it adds no collective: Equinox's value_and_grad traded
        17 more for 768 B) as the candidate cheapest for its outputs too, moved into the
        layouts their consumers need (:meth:`taking`'s ``around``): a CNN's flattened
        channel-split activations (``S(0),_S(1, 16)``) gathered for the logits and the dense
        layer's weight gradient, the latter computed replicated (its batch-split operand
        gathered over ``dp``) as the update already takes it, where the cheapest for its
        inputs alone split it over the classes and the whole update cascaded split into three
        all-gathers at the end (tests/models/cnn.py's one-conv step: 9,556 -> 7,780 B, 5 ->
        4 collectives after the combiner; before strided splits were gathered: 24,916 B in
        7). A
        replicated parameter's gradient made split (an embedding table's, scattered from
        the activation gradient moved to split the model dim) otherwise runs the clip and
        the whole update split and all-gathers the parameter and both moments at the end,
        one gather each, where gathering the gradient once costs one (the scan-over-layers
        LM of tests/models/stacked.py: 33,972 -> 21,844 B, 1.41 -> 0.91x XLA's). Offered in
        every descent with value moves, Llama's adamw step went 133,866 -> 159,082 B
        (another basin); with the layouts its consumers need too and with the consumers
        alone too, it went to 127,626 B but its cold predict took 9% longer (2.44 -> 2.66 s
        CPU), and to 130,794 B (+6%) with those layouts cascading only; gathering every
        split value (its result unchanged) +12% (2.42 -> 2.71 s), near the outputs alone
        +0% (2.47 -> 2.47 s; medians of 3 alternated in one process, load 4-5). Also with
        ``gathers``: any split value with one mesh dim's split gathered where a consumer's
        output is all-gathered over it next (:meth:`hoisted`), the gather moved before the
        fan-out; and a partial value near those outputs reduced into the layout a fixed
        output of its shape keeps (:attr:`kept_states`: a weight gradient partial over
        ``dp`` and ``tp`` reduce-scattered over ``tp`` into its parameter's split and
        all-reduced over ``dp``, where it was reduce-scattered over ``dp``, all-reduced over
        ``tp`` and all-gathered over ``dp`` for its replicated consumers, which then sliced
        it: tests/models/cnn.py's first conv kernel, 1,944 -> 1,512 B as compiled, one
        collective fewer), with one consumer too (its first bias's gradient reduced so,
        ``tp`` before ``dp`` as the kernel's, the two ``tp`` all-reduces are independent
        and CPU XLA combines them; GPT-2's value_and_grad of benchmarks/dump_predictions.py
        41,248 -> 40,992 B, 20 -> 19 collectives after the combiner).
        ``common`` (:func:`_continued`'s last descent): a value without partials moved, for
        every consumer, into any layout each of them has a candidate taking it in (none of
        them may need it yet): the float32 Llama scan's logits, read on the vocabulary
        split by the max, the shifted logits, the masked lookup and the gradient, all moved
        to the sequence split at once (the whole loss there: -576 by the AG/A2A 8,192
        objective, where one consumer re-chosen alone costs +8,672 or more). Only layouts
        one mesh dim apart from the value's (:func:`_one_dim_apart`) that split it no more
        (one mesh dim's split gathered or moved, never made): every common move the
        descent applied on the 34 programs measured (section 14's 15 and the dump's 19
        under AG/A2A 8,192) gathered or moved one mesh dim's split, and with the others
        offered too it evaluated 3,932 value moves on Llama's 2x4 adamw step (0.82 s CPU of
        its 3.3 s cold predict), 745 without them (0.21 s; the 34 predictions identical);
        the splits made too were 734 of the default's last descent (:func:`_commoned`)
        where 562 (GPT-2's 442 where 262), every prediction of section 14's 17 programs
        and the dump's 19 the same, under either model. With ``taken`` (:func:`_continued`'s
        common descent) also, as strict moves only (``around``), the value's own layout
        where some consumer moves it and a strided value's strided split gathered to a
        plain layout (:func:`_taken_as_made`); a strict move cascades with its own
        tie-break and look-ahead (:meth:`evaluate`).
        Each consumer takes the candidate cheapest for its other inputs that needs the
        value in that layout; a layout some consumer cannot take is skipped. :meth:`improve`
        tries each move cascading and with the consumers alone: a bias gradient summing an
        activation gradient partial over ``tp`` reads it as its matmul consumers already
        have it, all-reduced, and is then partial over ``dp`` only (as XLA does), but the
        cascade re-chooses everything downstream of it greedily into a dearer plan. With
        the consumers alone a move is taken only if it adds no collective (Equinox's
        value_and_grad traded two more for bytes)."""
        consumers = self.consumers.get(value, ())
        if not consumers or value[0] == "in":
            return []
        path, j = value
        state = self.outs[path][choice[path]][j]
        arounds: tuple[bool, ...] = (False,)
        strict: tuple[State, ...] = ()  # targets taken for the consumers' outputs too only (``around``)
        near = gathers and any(c in self.near_fixed_outputs for c, _ in consumers)
        if len(consumers) < 2 and not (near and any(state[1])):
            return []
        if any(state[1]):
            targets = dict.fromkeys(((state[0], (None,) * len(state[1])), *self.needs(value, choice)))
            if near:  # reduced into the layout its parameter keeps (:attr:`kept_states`)
                targets.update(dict.fromkeys(self.kept_states.get(self.out_avals[path][j], ())))
            targets.pop(state, None)
        elif common:  # in the first consumer's candidates' order (a PRNG key's consumers take it Replicate only)
            takes = [self.candidates[c].by_in[i] for c, i in consumers]
            targets = dict.fromkeys(
                x for x in takes[0]
                if x != state and _one_dim_apart(state, x) and _splits(x) <= _splits(state)
                and all(x in other for other in takes[1:])
            )
            strict = _taken_as_made(state, self.needs(value, choice), takes) if taken else ()
        elif gathers and any(state[0]):
            replicated = ((tuple(() for _ in state[0]), state[1]),) if near else ()
            targets = dict.fromkeys(replicated + self.hoisted(value, state, choice))
            arounds = (False, True)
        else:
            return []
        moves: list[tuple[tuple[tuple[str, int], ...], bool]] = []
        for target, around in [*((t, a) for t in targets for a in arounds), *((t, True) for t in strict)]:
            seeds = self.taking(value, target, choice, around)
            if seeds is not None and any(choice[c] != k for c, k in seeds) and (seeds, False) not in moves:
                moves.append((seeds, around))
        return moves

    def hoisted(self, value: ValueId, state: State, choice: Choice) -> tuple[State, ...]:
        """A split ``value``'s state (``state``, plain) with one mesh dim's split gathered, per
        mesh dim some consumer's output is split over and all-gathered over for some of its
        own consumers at ``choice``: :meth:`value_moves` (``gathers``) gathers it once
        before its consumers. A CNN's pre-activation feeds the ReLU, whose output the next
        conv gathers over ``tp``, and the ReLU's mask, which the backward gathers over
        ``tp`` too; gathered before both, the mask's all-gather goes (tests/models/cnn.py's
        two-conv step: 1,536 B and one collective); Llama's value_and_grad of
        benchmarks/dump_predictions.py: 124,640 -> 118,400 B, 26 -> 23 collectives after
        XLA's combiner."""
        if len(state) > 2:  # a strided split: gathered to Replicate only (above)
            return ()
        found: dict[State, None] = {}
        for c, _ in self.consumers.get(value, ()):
            for j, out in enumerate(self.outs[c][choice[c]]):
                for m in {a for axes in out[0] for a in axes}:
                    if any(m in axes for axes in state[0]) and any(
                        all(m not in axes for axes in need[0]) for need in self.needs((c, j), choice)
                    ):
                        found[(tuple(tuple(a for a in axes if a != m) for axes in state[0]), state[1])] = None
        return tuple(found)

    def taking(
        self, value: ValueId, target: State, choice: Choice, around: bool = False
    ) -> tuple[tuple[str, int], ...] | None:
        """Every consumer of ``value`` re-chosen to take it in ``target``: (consumer,
        candidate) per consumer, each the candidate cheapest for its other inputs as they
        arrive at ``choice`` among those needing the value so (``around``: for its outputs
        too, moved into the layouts their consumers need at ``choice``,
        :meth:`cheapest_around`); None when some consumer has no such candidate."""
        slots: dict[str, list[int]] = {}
        for c, i in self.consumers.get(value, ()):
            slots.setdefault(c, []).append(i)
        seeds = []
        for c, at in slots.items():
            arriving = list(self.arriving(c, choice))
            for i in at:
                arriving[i] = target
            ins = self.ins[c]
            fits = [k for k in self.candidates[c].by_in[at[0]].get(target, ()) if all(ins[k][i] == target for i in at)]
            if not fits:
                return None
            if around:
                needs = [self.needs((c, j), choice) for j in range(len(self.out_avals[c]))]
                seeds.append((c, self.cheapest_around(c, fits, arriving, needs)))
            else:
                seeds.append((c, self.cheapest(c, fits, arriving)))
        return tuple(seeds)

    def reduced_moves(self, path: str, choice: Choice) -> list[tuple[tuple[str, int], ...]]:
        """*Reduced moves* (the finishing descents': :meth:`improve`'s ``reducing``): an
        equation making partials (as chosen, or, where an input is redistributed at a cost,
        the candidate cheapest for its inputs: a reduction over the dim its input is split
        on, taking it as it comes) with every consumer of each partial output taking it
        reduced to Replicate on those mesh dims (one all-reduce), the seeds of one cascade
        that breaks its ties by the fewest inputs moved in every descent (:meth:`evaluate`).
        Optax's integer-label cross-entropy with the label's logit looked up where the
        logits are split on the vocabulary (a masked lookup, free): its logsumexp summed the
        exponentials moved to the sequence split (an all-to-all, 768 B, which the
        gradient's ``mul`` took too, and its result moved back by another), or summed them
        where they are split and reduce-scattered the sums to the sequence split for their
        consumers (priced on CPU as the all-reduce), the label's partial logit all-gathered
        to meet them (Equinox's adamw step). Re-chosen so by a value move
        (:meth:`value_moves`) or by the cheapest-input move, the cascade broke the ties of
        the gradient's chain by the candidates' order in the pull descents: each free slice
        of the replicated sums to the sequence split ranks first, the chain stayed there and
        the all-to-all before the ``mul`` with it (Flax NNX's value_and_grad: 53,178 ->
        53,226 by the objective, not lower). With the fewest inputs moved the chain keeps
        the sums replicated and the ``mul`` slices them on the vocabulary split: both
        all-to-alls gone (51,306; 44,720 -> 43,232 B, docs/inference.md section 6).

        Only where the partial has several consumers (one all-reduce shared) and some of them
        changes, in the finishing descents, as measured on benchmarks/dump_predictions.py:
        offered at one consumer too, Llama's 2x4 adamw step went 29 -> 33 collectives after
        XLA's combiner (133,098 -> 132,154 B; the 4x2 one 247,892 -> 199,764 B, 62 -> 58);
        where no consumer changes, the Megatron MLP step's all-reduce moved from a ``sub``'s
        input to its output, the same bytes, 10 -> 11 collectives as walked; offered in every
        descent with value moves, that too, and Llama's (8,) step with a batch of 8 ended
        at 312,935 B where 311,591 (GPT-2's 4x2 adamw step 48,516 -> 47,620 B, 30 -> 29;
        Equinox's adamw step 43,424 B in 17 where 43,712 in 19)."""
        arriving = self.arriving(path, choice)
        k = choice[path]
        best = self.cheapest(path, range(len(self.ins[path])), arriving) if self.redistributes(path, k, arriving) else k
        made = self.outs[path][best]
        if not any(op for state in made for op in state[1]):
            return []
        # the consumers' other inputs as they arrive with ``path`` re-chosen
        trial = choice if best == k else {**choice, path: best}
        seeds = {path: best}
        for j, state in enumerate(made):
            if not any(state[1]):
                continue
            if len(self.consumers.get((path, j), ())) < 2:
                return []
            taking = self.taking((path, j), (state[0], (None,) * len(state[1])), trial)
            if taking is None or any(seeds.get(c, kc) != kc for c, kc in taking):  # a consumer of two partials apart
                return []
            seeds.update(taking)
        if all(choice[c] == kc for c, kc in seeds.items() if c != path):  # its consumers already take it so
            return []
        return [tuple(seeds.items())]

    def cheapest_around(
        self, path: str, ks: Sequence[int], arriving: Sequence[State], needs: Sequence[tuple[State, ...]]
    ) -> int:
        """The candidate among ``ks`` (not empty) of ``path`` cheapest with every other
        equation as chosen: the least ``(cost, k)``, the cost being the redistribution of
        ``arriving`` inputs into it, its outputs' charges and the redistribution of its
        outputs into the layouts their consumers need (``needs``: per output, each once). A
        candidate is left once its bytes so far exceed the best's (costs are >= 0), before
        the rest of its plans are priced."""
        costs = self.input_costs(path, arriving)
        best, best_key, bound = ks[0], None, math.inf
        for k in ks:
            found = self._around_cost(path, k, costs[k], needs, bound)
            if found is not None and (best_key is None or (found, k) < best_key):
                best, best_key, bound = k, (found, k), found[0]
        return best

    def _around_cost(
        self, path: str, k: int, input_cost: Cost, needs: Sequence[tuple[State, ...]], bound: float
    ) -> Cost | None:
        """:meth:`cheapest_around`'s cost of candidate ``k`` (``input_cost``: its inputs'
        redistribution; ``needs``: per output, the layouts its consumers need), or None once
        its bytes exceed ``bound``."""
        nbytes, steps = input_cost
        if nbytes > bound:
            return None
        for j, (aval, out) in enumerate(zip(self.out_avals[path], self.outs[path][k])):
            owed = self.charge((path, j), aval, out)
            nbytes, steps = nbytes + owed[0], steps + owed[1]
            for need in needs[j]:
                if nbytes > bound:
                    return None
                move = self.cost(aval, out, need)
                nbytes, steps = nbytes + move[0], steps + move[1]
            if nbytes > bound:
                return None
        return nbytes, steps

    def multi_partial(self, choice: Choice) -> list[str]:
        """The equations with an input redistributed that arrives partial on several mesh
        dims, some of which it needs reduced (:func:`_one_reduced`), or split over several
        mesh dims, some of which it needs gathered (:func:`_one_gathered`)."""
        found = []
        for path in self.paths:
            for i, fixed in enumerate(self.fixed[path]):
                if fixed is None:
                    src, j = self.sources[path][i]  # type: ignore[misc]
                    arriving, need = self.outs[src][choice[src]][j], self.ins[path][choice[path]][i]
                    if _one_reduced(arriving, need) or _one_gathered(arriving, need):
                        found.append(path)
                        break
        return found

    def pull_moves(
        self, path: str, choice: Choice, carry_pulls: bool = False, partly: bool = False
    ) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
        """Moves giving an input of ``path`` that is redistributed the layout ``path``
        needs at its producer: the producer re-chosen to make it (the candidate cheapest
        for its inputs), and so upstream while its own inputs would be redistributed
        (at most ``_PULL_DEPTH`` equations), then cascading downstream. A cascade only
        goes downstream: a layer norm whose elementwise chain chose, at no cost, a
        sequence split that the next matmul all-gathers back is re-chosen as a whole
        only from its consumer (per input: (input, seeds)). Kept with the choices they
        read (of ``path``, of the equations re-chosen and of their producers): the pull
        descents offer them at every equation near each applied move, again from one
        descent to the next (on Llama's adamw step 5,459 offers, each ~15 us found anew,
        7% of the search; kept so, 2,135 are found anew). ``carry_pulls``: through loops'
        carries too (:meth:`_pull`); ``partly``: an input arriving partial on several mesh
        dims also pulled with one of those reduced (:func:`_one_reduced`), and diamonds
        pulled through (:meth:`_pull`'s ``diamonds``)."""
        known = self.pulls_by_reads.setdefault((path, carry_pulls, partly), [])
        for getter, snapshot, moves in known:
            if getter(choice) == snapshot:
                return moves
        moves, read = [], {path}
        for i, fixed in enumerate(self.fixed[path]):
            if fixed is not None:
                continue
            src, j = self.sources[path][i]  # type: ignore[misc]
            need = self.ins[path][choice[path]][i]
            read.add(src)
            arriving = self.outs[src][choice[src]][j]
            if arriving == need:
                continue
            for target in (need, *(_one_reduced(arriving, need) if partly else ())):
                seeds: dict[str, int] = {}
                pulled = self._pull(
                    src, j, target, choice, seeds, read, carry_pulls, through_free=target is need, diamonds=partly
                )
                if pulled and any(choice[p] != k for p, k in seeds.items()):
                    moves.append((i, tuple(seeds.items())))
        getter = _getter(tuple(read))
        known.append((getter, getter(choice), moves))
        return moves

    def _pull(
        self, path: str, j: int, need: State, choice: Choice, seeds: dict[str, int], read: set[str],
        carry_pulls: bool = False, through_free: bool = True, diamonds: bool = False,
    ) -> bool:
        """Re-choose ``path`` (into ``seeds``) to make output ``j`` in ``need``, and its
        producers so, upstream. True if every input then arrives as needed, by a costless
        move (a slice, a local partial) or from a producer that cannot make it (the
        redistribution moves up there); False if a function input or literal would pay
        a move (gathering an input instead of reducing a gradient: another plan than
        XLA's), and the caller keeps its own choice. A loop body's read of its carry, the
        loop re-chosen downstream of it (pulled through the value its body returns), arrives
        as the re-chosen loop carries it: priced as CPU XLA sends bfloat16, the replicated
        restart of the stacked LM's bfloat16 step accumulated under ``lax.scan`` left the
        embedding gradient's accumulator split over ``tp``, free to slice in the body and
        all-gathered after the loop, and only the body's add, the loop and its consumer
        re-chosen together remove that gather (9,776 B as compiled, 15,920 without). Only
        in the finish's last descent (``carry_pulls``): offered in every descent, they
        sent the float32 stacked step with 3 layers under ``scan(unroll=2)`` to a dearer
        basin (39,796 -> 40,080 B). ``read``: the equations whose choices it read, added to;
        ``through_free``: producers re-chosen upstream of a costless move too (else it
        stays: a partial sum's replicated terms made partial locally, :func:`_one_reduced`);
        ``diamonds``: an input whose producer this pull already re-chose for another of its
        consumers, making the layout wanted here, arrives so (a chain that forks and joins
        again, a softmax's max and sum of the same logits), where otherwise the pull fails
        there. Only in the one-dim-reduced descent (:func:`_partly`): in every pull descent
        they took Llama's 2x4 value_and_grad, adamw step and 4-layer adamw step of
        benchmarks/dump_predictions.py to basins with 2, 5 and 9 more collectives after
        XLA's combiner, and in the finish's last descent the 4x2 adamw step to a dearer one
        (172,356 -> 222,516 B)."""
        fits = self.candidates[path].by_out[j].get(need)
        if not fits or len(seeds) >= (_PULL_DEPTH if through_free else _PARTLY_DEPTH):
            return True  # the redistribution stays at its output
        read.add(path)
        read.update(self.producers[path])
        arriving = self.arriving(path, choice)
        best = seeds[path] = self.cheapest(path, fits, arriving)
        for i, (src, state) in enumerate(zip(self.sources[path], arriving)):
            want = self.ins[path][best][i]
            if state == want:
                continue
            costless = self.cost(self.in_avals[path][i], state, want) == _ZERO  # a slice, a local partial
            if costless and not through_free:
                continue
            if self.fixed[path][i] is None and src[0] in seeds:  # type: ignore[index]
                producer, k = src  # type: ignore[misc]
                made = self.outs[producer][seeds[producer]][k] == want
                if path.startswith(f"{producer}."):
                    # a loop body's read of its carry, the loop re-chosen downstream of it: it arrives as re-chosen
                    if carry_pulls and made:
                        continue
                elif made and diamonds:  # re-chosen by this pull for another consumer, making it already
                    continue
            elif self.fixed[path][i] is None:
                upstream = dict(seeds)
                pulled = self._pull(
                    src[0], src[1], want, choice, upstream, read, carry_pulls, through_free,  # type: ignore[index]
                    diamonds,
                )
                if pulled:
                    seeds.update(upstream)
                    continue
            if not costless:
                return False
        return True

    def cheapest(
        self, path: str, ks: Sequence[int], arriving: Sequence[State], free: Sequence[frozenset[State]] | None = None
    ) -> int:
        """The candidate among ``ks`` (not empty) cheapest for ``arriving`` inputs: the least
        ``(input_costs()[k], k)`` (:meth:`input_costs`, with ``free``); ``ks`` ascending (every
        index's are), so that the first of equal costs is the least ``k``."""
        return min(ks, key=self.input_costs(path, arriving, free).__getitem__)

    def redistributes(self, path: str, k: int, arriving: Sequence[State]) -> bool:
        """Whether candidate ``k`` of ``path`` pays to redistribute ``arriving`` inputs (where
        it does, the candidate cheapest for them is a move worth trying)."""
        return self.ins[path][k] != arriving and self.input_costs(path, arriving)[k] > _ZERO

    def input_costs(
        self, path: str, arriving: Sequence[State], free: Sequence[frozenset[State]] | None = None
    ) -> list[Cost]:
        """Per candidate of ``path``, the redistribution of ``arriving`` inputs into it:
        each input's moves priced once per distinct layout candidates need it in, then
        summed per candidate in input order (the search's hot loop: ~30 candidates of ~20
        distinct needs per input on the training steps). ``free``: per input, layouts it
        costs nothing in (another consumer of its value needs it so, :meth:`shared_needs`)."""
        arriving = tuple(arriving)
        key = (self.kinds[path], arriving)
        if free is None:
            known = self.input_cost_lists.get(key)
            if known is not None:
                return known
        table, kind, known_costs, cost = self.candidates[path], key[0], self.costs, self.cost
        totals: list[Cost] | None = None
        inputs = zip(self.in_avals[path], arriving, table.needed, table.need_index)
        for i, (aval, src, needed, index) in enumerate(inputs):
            moves = self.need_costs.get((kind, i, src))
            if moves is None:
                moves = self.need_costs[kind, i, src] = [  # cost()'s memo read inline
                    known_costs.get((aval, src, need)) or cost(aval, src, need) for need in needed
                ]
            if free is not None and free[i]:
                moves = [_ZERO if need in free[i] else move for need, move in zip(needed, moves)]
            if totals is None:
                totals = [moves[n] for n in index]
            else:
                totals = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(totals, map(moves.__getitem__, index))]
        if totals is None:  # no inputs
            totals = [_ZERO] * len(table.ins)
        if free is None:
            self.input_cost_lists[key] = totals
        return totals

    def delta(
        self, changes: dict[str, int], kept: dict[str, int], values: Collection[int], trial: Choice,
        settled: dict[int, Cost],
    ) -> Cost:
        """How much ``changes`` lower (negative) or raise the total from the choice they
        were made at, ``trial`` with them made (:meth:`cascaded`; ``kept``: the candidates
        they replaced), by the ``values`` they touch (:meth:`touched_by` of their paths in
        order): the cost of each value before (``settled``: value costs known before the
        changes, those found here added) and after, each sum in the order of ``values``;
        :data:`_NOT_LOWER` as soon as the sum after reaches the sum before (costs are >= 0:
        the rest cannot bring it below, and :meth:`improve` applies only deltas below zero).
        Most evaluations end there: ~80% of the cascades do not lower the total, and on
        Llama's adamw step half the values' costs after (124,458 of 250,003) were looked up
        before that was known. Priced on the cascade's own trial, changed back once by the
        caller, not changed back and made again here: with :meth:`improve` pushing no delta
        not below zero on its heap, the descents took 0.964x their time on Llama's 2-layer
        adamw step, 0.971x on GPT-2's (paired medians of 8 and 6 cold searches alternated in
        one process, load ~6). The sum before reads ``settled`` as it is, finding the costs
        it lacks on the first miss (1,101 of Llama's 12,782 deltas) instead of a set
        difference per delta: ~8.4 us where ~13.6 us for the ~108 values of one
        (microbenchmarked)."""
        tables, value_cost = self.value_costs, self.value_cost
        was_bytes = was_steps = 0.0
        try:
            for value_bytes, value_steps in map(settled.__getitem__, values):
                was_bytes += value_bytes
                was_steps += value_steps
        except KeyError:  # a value near the last applied move (~1 delta in 12): the costs before the changes found
            trial.update(kept)
            for value in set(values).difference(settled):
                decide, memo = tables[value]
                settled[value] = memo.get(decide(trial)) or value_cost(value, trial)
            trial.update(changes)
            return self.delta(changes, kept, values, trial, settled)
        nbytes = steps = 0.0
        for value in values:  # the hot loop of every evaluation: value_cost()'s memo read inline
            decide, memo = tables[value]
            value_bytes, value_steps = memo.get(decide(trial)) or value_cost(value, trial)
            nbytes += value_bytes
            steps += value_steps
            if nbytes >= was_bytes and (nbytes > was_bytes or steps >= was_steps):
                return _NOT_LOWER
        return nbytes - was_bytes, steps - was_steps

    def starts(self, eager: Choice) -> list[Choice]:
        """The starts of the descent: eager dispatch's choice, and the program walked again
        in program order with :meth:`greedy`, whose look-ahead waives the charge of a
        partial on a mesh dim some input is already partial on (``P + S(0)`` made
        ``P + P`` is not charged the reduction it owes), when that differs. Eager
        dispatch charges it (torch reduce-scatters ``P`` there instead), which is right
        op by op but starts the descent in another basin: from that start alone the
        Llama adamw step ends at 1.14 times the bytes and 220 collectives instead of
        180 (1.11 times from both; value moves, :meth:`value_moves`, then go below the
        old figures). Both are descended; the cheaper result is kept."""
        starts = [eager]
        walked = dict(eager)
        for node in self.graph.nodes:
            walked[node.path] = self.greedy(node.path, walked)
        if walked != eager:
            starts.append(walked)
        return starts

    def evaluate(self, move: Move, choice: Choice, settled: dict[int, Cost]) -> Evaluation:
        """A move's cascade from ``choice``: (how much it changes the total, the changes,
        every equation whose change makes it stale; :meth:`cascaded`). Kept per move with
        the choices it read (:meth:`cascaded`'s: those of the equations looked at and of
        their producers, and those the delta of the changes reads, their neighbours') and,
        if its cascade met a tie the two tie-breaks break apart, the tie-break: a later
        descent (from another start, with pull moves, the finishing one) meeting the move
        there again reuses it."""
        known = self.evaluations.get(move)
        if known is None:
            known = self.evaluations[move] = []
        read, now = None, None
        for depends, snapshot, tie, found in known:
            if tie is None or tie == self.fewest_moved:
                if depends is not read:  # entries of one reading share its getter: the choices read once
                    read, now = depends, depends(choice)
                if now == snapshot:
                    return found
        fewest: bool | None = None  # the descent's tie-break (tie_moved())
        ahead = False
        if move[0] == _VALUE:  # every consumer of a value at once, cascading or the consumers alone
            seeds, follow, reduce = dict(move[3]), move[4], False
            if move[5]:
                # strict (each consumer cheapest for its outputs too): cascading, the ties broken by the fewest inputs
                # moved (the candidates' order sliced the one-conv CNN's per-example loss chain over tp for free, then
                # reduced it over both mesh dims) and near the fixed outputs looking ahead to the layouts they keep
                # (:meth:`_greedy_kept`); in every cascade, that look-ahead changed 13 of benchmarks/
                # dump_predictions.py's 19 predictions, 3 dearer (docs/inference.md, "Strict common value moves")
                fewest, ahead = True, True
        elif move[0] == _REDUCING:
            seeds, follow, reduce = {move[1]: move[2]}, True, True
        elif move[0] in (_PULL, _KEEPING_PULL):
            seeds, follow, reduce = dict(move[3]), True, False
        elif move[0] == _REDUCED:  # its own tie-break (reduced_moves()): the same in every descent
            seeds, follow, reduce, fewest = dict(move[2]), True, False, True
        elif move[0] == _KEEPING:
            seeds, follow, reduce = {move[1]: move[2]}, True, False
        else:
            seeds, follow, reduce = {move[0]: move[1]}, move[2], False
        changes, kept, seen, tied, held = self.cascaded(
            seeds, choice, follow, reduce, fewest, move[0] in (_KEEPING, _KEEPING_PULL), ahead)
        tied = tied and fewest is None  # a forced tie-break holds for both descents
        key = (seen, tuple(changes))  # the changes in order: touched_by()'s order, the sums'
        reading = self.readings.get(key)
        if reading is None:
            depends = functools.reduce(operator.or_, map(self.reach.__getitem__, seen))
            if len(seen) * _WHOLE > len(self.paths):  # a cascade through much of the program: kept by every choice
                getter = self.everything
            else:
                looked = frozenset(map(self.paths.__getitem__, seen))
                # the neighbours of those changed include what their greedy() reads (producers, a stacking node's
                # consumers)
                getter = _getter(tuple(looked.union(
                    *map(self.neighbours.__getitem__, changes),
                    *map(self.greedy_reads.__getitem__, looked.difference(changes)),
                )))
            reading = self.readings[key] = (depends, getter, self.touched_by(key[1]))
        depends, getter, values = reading
        delta = self.delta(changes, kept, values, choice, settled)
        choice.update(kept)
        # the consumers alone, or taking the value for their outputs too (value_moves' strict): never more collectives
        if move[0] == _VALUE and (not follow or move[5]) and delta[1] > 0:
            delta = (math.inf, math.inf)  # (Equinox's value_and_grad traded 2 more for bytes; 17 more for 768 B)
        found = (delta, changes, depends)
        # the choices it read as the memo's check above read them where it read this getter (``choice`` is as it
        # was then: the cascade's changes were changed back)
        entry = (getter, now if getter is read else getter(choice), self.fewest_moved if tied else None, found)
        known.append(entry)
        if move[0] == _KEEPING and not held:  # no equation kept its candidate: the plain cascade's evaluation too
            self.evaluations.setdefault((move[1], move[2], True), []).append(entry)
        return found

    def improve(
        self, choice: Choice, values: bool = False, reducing: bool = False, pulls: bool = False,
        offered: Collection[str] | None = None, gathers: bool = False, carry_pulls: bool = False,
        partly: bool = False, common: bool = False, keeping: bool = False, taken: bool = False,
        keeping_pulls: bool = False, every: bool = False,
    ) -> Choice:
        """Steepest descent over cascading moves (see :meth:`alternatives`): apply the
        move lowering the total most (ties: the earliest equation), until none lowers it
        (at most ``_MOVES``). Evaluations are lazy: after a move, those depending on an
        equation it changed are stale, and re-evaluated only when their old delta comes
        first (a stale delta is an estimate; only fresh ones are applied). ``values``: value
        moves too (:meth:`value_moves`); ``reducing``: reducing cascades and reduced moves too
        (:meth:`reducing_moves`, :meth:`reduced_moves`); ``gathers``: value moves gathering split values too
        (:meth:`value_moves`); ``common``: value moves of values without partials into a
        layout all their consumers can take (:meth:`value_moves`; ``taken``: its strict targets too);
        ``keeping``: every cascading
        move of :meth:`alternatives` also as a keeping cascade (:meth:`keeps`); ``pulls``: pull moves too
        (:meth:`pull_moves`; ``carry_pulls``: through loops' carries too; ``partly``: with one mesh dim's
        partial reduced too); ``keeping_pulls``: every pull move also as a keeping cascade; ``every``: every
        other candidate of an equation where something costs, not cascading (:meth:`every_candidate`).
        ``offered``: the equations offered moves first (None: every one; then those near
        each applied move)."""
        choice = dict(choice)
        evaluated: dict[Move, Evaluation] = {}
        # the evaluations not stale, by their depends: those an applied move can make stale (a stale one is
        # scanned no more: the large cascades, which depend on most equations, go stale at the first moves)
        fresh: dict[Move, int] = {}
        heap: list[tuple[Cost, int, Move]] = []
        settled: dict[int, Cost] = {}  # value costs at choice (each delta's before), dropped where a move changes them

        def evaluate(move: Move) -> None:
            evaluated[move] = found = self.evaluate(move, choice, settled)
            fresh[move] = found[2]
            if found[0] < _ZERO:  # the loop below pops the heap only while its top is below zero
                heapq.heappush(heap, (found[0], self.position[move[0] if move[0] not in _KINDS else move[1]], move))

        def current(move: Move) -> bool:
            if move[0] == _VALUE:
                return move[3:4] + move[5:] in self.value_moves((move[1], move[2]), choice, gathers, common, taken)
            if move[0] == _REDUCING:
                return move[2] in self.reducing_moves(move[1], choice)
            if move[0] in (_PULL, _KEEPING_PULL):
                return move[2:] in self.pull_moves(move[1], choice, carry_pulls, partly)
            if move[0] == _REDUCED:
                return move[2] in self.reduced_moves(move[1], choice)
            if move[0] == _KEEPING:
                return (move[2], True) in self.alternatives(move[1], choice, reducing)
            if every and not move[2] and move[1] in self.every_candidate(move[0], choice):
                return True
            return move[1:] in self.alternatives(move[0], choice, reducing)

        def offer(paths: Any) -> None:
            for path in sorted(paths, key=self.position.__getitem__):
                for k, follow in self.alternatives(path, choice, reducing):
                    # the keeping cascade first: where no equation keeps its candidate it is the plain one (evaluate())
                    if keeping and follow and (_KEEPING, path, k) not in fresh:
                        evaluate((_KEEPING, path, k))
                    if (path, k, follow) not in fresh:
                        evaluate((path, k, follow))
                for k in self.every_candidate(path, choice) if every else ():
                    if (path, k, False) not in fresh:
                        evaluate((path, k, False))
                for k in self.reducing_moves(path, choice) if reducing else ():
                    move = (_REDUCING, path, k)
                    if move not in fresh:
                        evaluate(move)
                for i, seeds in self.pull_moves(path, choice, carry_pulls, partly) if pulls or keeping_pulls else ():
                    for kind in (_PULL,) * pulls + (_KEEPING_PULL,) * keeping_pulls:
                        move = (kind, path, i, seeds)
                        if move not in fresh:
                            evaluate(move)
                for seeds in self.reduced_moves(path, choice) if reducing else ():
                    move = (_REDUCED, path, seeds)
                    if move not in fresh:
                        evaluate(move)
                for j in range(len(self.out_avals[path]) if values else 0):
                    found = self.value_moves((path, j), choice, gathers, common, taken)
                    if not found:  # most values (one consumer, or none moving)
                        continue
                    # a split value gathered (gathers: see value_moves) only cascading: its consumers alone would
                    # give their outputs Replicate where their consumers take them split
                    alone = (False,) if any(self.outs[path][choice[path]][j][1]) else ()
                    for seeds, strict in found:
                        for follow in (True, *alone):  # cascading, or the consumers alone (see value_moves)
                            move = (_VALUE, path, j, seeds, follow, strict)
                            if move not in fresh:
                                evaluate(move)

        offer(self.position if offered is None else offered)
        for _ in range(_MOVES):
            while heap and heap[0][0] < _ZERO:
                delta, _, move = heapq.heappop(heap)
                if move not in evaluated or evaluated[move][0] != delta:
                    continue  # superseded
                if move not in fresh:  # stale
                    if current(move):
                        evaluate(move)
                    else:
                        del evaluated[move]
                    continue
                break
            else:
                break
            _, changes, _ = evaluated.pop(move)
            del fresh[move]
            choice.update(changes)
            for value in self.touched_by(list(changes)):  # the values whose deciders changed
                settled.pop(value, None)
            # a scan (~250 applied moves on GPT-2's adamw step), one AND per fresh evaluation: an index of the
            # evaluations by the equations they depend on (~50 each) cost more to build than the scans it saved
            changed = functools.reduce(operator.or_, map(self.bits.__getitem__, changes), 0)
            for other in [other for other, depends in fresh.items() if depends & changed]:
                del fresh[other]
            near = set(changes)
            for path in changes:
                for j in range(len(self.out_avals[path])):
                    near.update(c for c, _ in self.consumers.get((path, j), ()))
                near.update(src[0] for src in self.sources[path] if src is not None and src[0] != "in")
            offer(near)
        return choice

    def regrouped(self, choice: Choice) -> Choice:
        """``choice`` with single moves (:meth:`alternatives`' cascading and not, and their
        keeping cascades) that leave the objective no dearer applied while one lowers
        :meth:`grouped`, the one lowering it most first (ties: the earliest equation): the
        descents' deltas are sums over values and cannot see XLA's combiner, so a move that
        only regroups collectives is a tie to them. optax.MultiSteps' backward layer scan
        carried its activation gradient partial over ``tp`` and reduced it at the body's
        start, where the norm weight's gradient, formed after that reduction and reduced
        over ``tp`` too, could not join it; the loop re-chosen to carry it reduced (the
        initial value all-reduced before the loop, the body's result at its end, the same
        bytes) puts both reductions at the body's end, one all-reduce (10 -> 9 collectives
        after the combiner, XLA's count, under the latency-bound model)."""
        choice = dict(choice)
        best = self.grouped(choice)
        for _ in range(_MOVES):
            bound, found = self.total(choice)[0], None
            settled: dict[int, Cost] = {}  # value costs at choice, shared by the round's evaluations
            # the round's trials by their changes in order: a move changing what an earlier one did, in the same order
            # (a cascade and its keeping cascade often do), is that trial again, with the same sums (no_dearer()), and
            # cannot lower ``best`` twice (about half of GPT-2's adamw step's ~1,470)
            tried: set[tuple[tuple[str, int], ...]] = set()
            for path in self.paths:
                for k, follow in self.alternatives(path, choice):
                    for move in (*(((_KEEPING, path, k),) if follow else ()), (path, k, follow)):
                        delta, changes, _ = self.evaluate(move, choice, settled)
                        if not changes:
                            continue
                        key = tuple(changes.items())
                        if key in tried:
                            continue
                        tried.add(key)
                        if not self.no_dearer(delta, changes, choice, bound):
                            continue
                        trial = {**choice, **changes}
                        grouped = self.grouped(trial)
                        if grouped < best:
                            best, found = grouped, trial
            if found is None:
                break
            choice = found
        return choice

    def no_dearer(self, delta: Cost, changes: dict[str, int], choice: Choice, bound: float) -> bool:
        """Whether ``changes`` (a move's evaluation at ``choice``, its ``delta``) leave the
        objective's bytes at most ``bound`` (``choice``'s total): decided by the values the
        changes touch where their bytes differ clearly (``delta``'s own where it was summed
        to the end, else summed here), by the whole total (:meth:`total`, a sum over every
        value) only at a tie, where a rounding of the two sums' orders could differ. The
        whole total per move was 0.45 s of :meth:`regrouped`'s 1.2 s (profiled) on Llama's
        adamw step under the AG/A2A 8,192 model: 824 totals of 1,559 moves, ~100 ties."""
        tolerance = 1e-9 * max(1.0, abs(bound))
        if delta[0] != math.inf:
            difference = delta[0]
        else:  # delta() stopped at the first value reaching the bytes before: the values summed here to the end
            values = self.touched_by(list(changes))
            before = self.around(values, choice)[0]
            kept = {path: choice[path] for path in changes}
            choice.update(changes)
            difference = self._bytes_above(values, choice, before, tolerance)
            choice.update(kept)
            if difference is None:
                return False
        if abs(difference) > tolerance:
            return difference < 0
        return self.total({**choice, **changes})[0] <= bound

    def _bytes_above(self, values: Collection[int], choice: Choice, before: float, tolerance: float) -> float | None:
        """The bytes of ``values`` at ``choice`` less ``before`` (:meth:`around`'s sum in
        the same order), or None as soon as a partial sum passes ``before`` by more than
        ``tolerance``: every cost is >= 0 and float addition and subtraction are monotone,
        so the whole difference would pass it too (:meth:`no_dearer` returns False there
        either way; ~90% of its calls on GPT-2's adamw step, summed to the end before)."""
        nbytes = 0.0
        for value in values:
            nbytes += self.value_cost(value, choice)[0]
            if nbytes - before > tolerance:
                return None
        return nbytes - before

    def total(self, choice: Choice) -> Cost:
        """The objective: every edge's redistribution plus the outputs' charges (per choice,
        found once: the descents' results are compared several times)."""
        key = self.everything(choice)
        known = self.totals.get(key)
        if known is None:
            known = self.totals[key] = self.around(self.values, choice)
        return known
