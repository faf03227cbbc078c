#!/usr/bin/env bash
# Regenerates docs/benchmarks.md and its pictures (docs/img/) from one run
# of gpipe-bench: every number on that page comes from this script's run.
# It builds first (scripts/setup.sh). Most of the run is the accuracy
# table (39 trainings); the page gives each section's seconds.
#
#   ./scripts/benchmarks.sh                 # the whole page
#   ACCURACY_EPOCHS=1 ./scripts/benchmarks.sh   # a shorter accuracy table
#
# The page says which machine, commit and date it was run on; the raw JSON
# and printed tables of each section are kept in docs/bench-output/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"

bench="$root/build/bench/gpipe-bench"
launcher="$root/build/tools/gpipe-run"
img="$root/docs/img"
raw="$root/docs/bench-output"
page="$root/docs/benchmarks.md"
mkdir -p "$img" "$raw"
# The commit measured, and whether the code differed from it, taken before
# the run rewrites the page's own (tracked) files.
commit=$(git -C "$root" rev-parse --short HEAD)
dirty=$(git -C "$root" status --porcelain --untracked-files=no -- . \
  ':!docs/benchmarks.md' ':!docs/img' ':!docs/bench-output' |
  grep -q . && echo " with uncommitted changes" || true)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# section NAME [FLAGS...]: runs `gpipe-bench --only NAME FLAGS...`, keeps
# its printed output and JSON in docs/bench-output/, and leaves its
# Markdown tables in $work/NAME.md.
section() {
  local name=$1
  shift
  echo "== benchmarks.sh: $name" >&2
  local start=$SECONDS
  (cd "$work" && "$bench" --only "$name" --json "$raw/$name.json" \
    --markdown "$work/$name.md" "$@") | tee "$raw/$name.txt" >&2
  echo "== benchmarks.sh: $name took $((SECONDS - start)) s" >&2
  seconds[$name]=$((SECONDS - start))
}
declare -A seconds

accuracy_epochs=${ACCURACY_EPOCHS:-2}
section accuracy --seeds 3 --accuracy-epochs "$accuracy_epochs" \
  --accuracy-limit 20000
section unet-memory --svg-dir "$img"
section unet-speed --iters 3 --svg-dir "$img"
section speed
section schedules
section autotune
section memory
section overhead
section cell-cost
section inference
section conv
section microbatch
section trace
section random
section checkpoint
echo "== benchmarks.sh: dist" >&2
start=$SECONDS
(cd "$work" && "$launcher" -n 2 -- "$bench" --only dist \
  --json "$raw/dist.json" --markdown "$work/dist.md" \
  --dist-trace "$img/dist-trace") | tee "$raw/dist.txt" >&2
seconds[dist]=$((SECONDS - start))
echo "== benchmarks.sh: dist on 4 ranks" >&2
start=$SECONDS
(cd "$work" && "$launcher" -n 4 -- "$bench" --only dist \
  --json "$raw/dist-4-ranks.json" --markdown "$work/dist-4-ranks.md" \
  --dist-trace "$img/dist-4-ranks-trace") | tee "$raw/dist-4-ranks.txt" >&2
seconds[dist-4-ranks]=$((SECONDS - start))
echo "== benchmarks.sh: mesh" >&2
start=$SECONDS
(cd "$work" && "$launcher" -n 4 -- "$bench" --only mesh \
  --json "$raw/mesh.json" --markdown "$work/mesh.md") |
  tee "$raw/mesh.txt" >&2
seconds[mesh]=$((SECONDS - start))
# The U-Net speed table across 2 and 4 processes.
for n in 2 4; do
  name=unet-speed-$n-ranks
  echo "== benchmarks.sh: $name" >&2
  start=$SECONDS
  (cd "$work" && "$launcher" -n "$n" -- "$bench" --only unet-speed --iters 3 \
    --json "$raw/$name.json" --markdown "$work/$name.md") |
    tee "$raw/$name.txt" >&2
  seconds[$name]=$((SECONDS - start))
done
# Paths relative to the project, not to the machine that ran it.
sed -i "s#$root/##g" "$work"/*.md "$raw"/*.txt "$raw"/*.json

# The page: prose without numbers, then each section's tables as measured.
table() { cat "$work/$1.md"; }
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
blas=$(sed -n 's/^# blas: //p' "$raw/speed.txt" | head -1)
{
  cat <<EOF
# Benchmarks

Written by \`scripts/benchmarks.sh\` on $(date -u +%Y-%m-%d) from commit
$commit$dirty: every number on this page comes from that run. Machine: $(nproc)
cores ($cpu), LibTorch $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo unknown),
$blas. Each section's printed output and JSON are in
[bench-output/](bench-output/). The machine is shared and noisy: compare
ratios within one section, not across runs. Hand-written analyses of earlier
runs are in [benchmark-history.md](benchmark-history.md).

torchgpipe's README has three tables: accuracy with and without
pipelining, the largest U-Net per memory budget, and speed-up per device
count. The first three sections are ours, scaled to a CPU with two cores:
each lane (a partition's thread) stands for one device.

## Accuracy parity (\`--only accuracy\`, ${seconds[accuracy]} s)

The small ResNet of \`gpipe::models\` (\`resnet_small\`, 39 layers with
BatchNorm) trained on Fashion-MNIST as the plain model (2 intra-op threads)
and through GPipe on 2 lanes (one thread each), at chunks 4 and 8, with
DeferredBatchNorm off and on, in each checkpoint mode; the same seeds
(initial weights and data order) and hyper-parameters for every row (SGD
with momentum 0.9, the rate decaying to 0 by a cosine over the run's
steps). The runs are short (the first 20,000 training images, a few
epochs) because two cores have to afford 39 of them: the error is far from
the model's best, and the table compares the rows, not the error itself.
The error is top-1 on the 10,000 test images, mean and sample deviation over
the seeds; \`difference_to_plain\` is the row's mean minus the plain
model's. Checkpointing only changes when activations are computed, not
their values, so its three rows agree; micro-batches change BatchNorm's
batch statistics in training, which is what torchgpipe's table tests.

\`\`\`sh
gpipe-bench --only accuracy --seeds 3 --accuracy-epochs $accuracy_epochs --accuracy-limit 20000
\`\`\`

EOF
  table accuracy
  cat <<EOF

## Memory: the largest U-Net per budget (\`--only unet-memory\`, ${seconds[unet-memory]} s)

torchgpipe's U-Net(B, C) (\`gpipe::models::unet\`: B convolutions per cell,
C base channels, skips from each encoder level to its decoder level)
trained on batches of 16 images of 3x32x32 at chunks 8, without dropout
and without optimizer state. Each lane counts as one device: its
parameters plus the peak of the bytes its thread allocates and has not
freed (a counting wrapper around LibTorch's CPU allocator; the batch and
the loss, made on the caller's thread, count on the first device). An
activation or a stashed skip is counted on the lane that made it until it
is freed, as on GPUs until the engine copies it to the next device.
\`device_peak_mib\` is the fullest device's peak, \`counted_total_mib\` the
devices' sum, and \`peak_rss_mib\` the process's peak resident memory in
the same step (after handing malloc's free pages back), which also holds
LibTorch's code and the data. For each width C, B doubles until a step no
longer fits the budget, then the largest B that fits is found between;
the row is the fitting model with the most parameters. More devices fit bigger models, as in torchgpipe's table.

\`\`\`sh
gpipe-bench --only unet-memory --svg-dir docs/img
\`\`\`

EOF
  table unet-memory
  cat <<EOF

![Peak memory of the fullest device against parameters](img/unet-memory.svg)

## Speed: U-Net through 1, 2 and 4 lanes (\`--only unet-speed\`, ${seconds[unet-speed]} s)

A U-Net(2, 16) training step (mean squared error, checkpoint except_last,
one intra-op thread per lane) through \`train_step\` under each schedule
(interleaved with 2 stages per lane), against the plain model on 1 and on
2 threads. The bound is fill-drain's n·m/(m+n−1) for n devices and m
micro-batches; here n lanes share two cores, so no row can pass 2, and
every micro-batch pays LibTorch's fixed cost per operation (109 layers,
forward, recomputation and backward), which grows with m.

\`\`\`sh
gpipe-bench --only unet-speed --iters 3 --svg-dir docs/img
\`\`\`

EOF
  table unet-speed
  cat <<EOF

![Speed-up against micro-batches, with the bounds](img/unet-speedup.svg)

One step on 4 lanes at 4 micro-batches, fill-drain then 1F1B (forward,
backward and recomputation boxes per lane; white is the bubble):

![Timeline, fill-drain](img/unet-timeline-fill_drain.svg)

![Timeline, 1F1B](img/unet-timeline-1f1b.svg)

### The same U-Net across processes

The same step with one stage per process (two with the interleaved
schedule) over Gloo on loopback, one intra-op thread per process: the
rows of the table above on 2 and on 4 ranks. \`one_process_ms\` is the
same pipeline as lanes of one process, and the plain model's times, both
measured on rank 0 in the same run while the other ranks wait;
\`speedup_vs_one_process\` above 1 means the processes are faster.

\`\`\`sh
gpipe-run -n 2 -- gpipe-bench --only unet-speed --iters 3   # and -n 4
\`\`\`

### On 2 processes (${seconds[unet-speed-2-ranks]} s)

EOF
  table unet-speed-2-ranks
  cat <<EOF

### On 4 processes (${seconds[unet-speed-4-ranks]} s)

EOF
  table unet-speed-4-ranks
  cat <<EOF

## Speed: 16 x (Linear(1024,1024)+ReLU), batch 256 (\`--only speed\`, ${seconds[speed]} s)

Training steps of the plain Sequential (1 and 2 threads), of GPipe on one
lane (the same micro-batches one after the other) and on two lanes, by
chunks and checkpoint mode. \`parallel_capacity\` is what two threads each
running half the layers give over one thread running both halves;
\`attainable\` is what fill-drain's 2m + 2 slots allow at that capacity,
2m / (2 + 2(m - 1) / capacity): the m - 1 slots that run both lanes at once
slowed to the capacity, the fill and drain not (efficiency is measured over
attainable, for the 2-partition rows of one thread per lane; \`-\` where a
row has no such figure).

EOF
  table speed
  cat <<EOF

## Schedules (\`--only schedules\`, ${seconds[schedules]} s)

All six schedules through \`train_step\` on 4 lanes and 8 micro-batches:
on layers that sleep a fixed time (so that cores and noise do not matter)
against \`gpipe::simulate\` of the same plan, and on 16 x Linear(1024) with
4 lanes sharing the 2 cores. On the fixed-cost layers (each a GELU and a
\`TimedLayer\` that sleeps 10 ms in forward, input part and weight part)
the bubble is measured from a trace of each step (\`Trace::summary\`: the
mean idle time per lane between the step's first and last cell), so that a
sleep running long counts as work; \`nominal_bubble_seconds\` is the
step's time less the layers' set costs, which counts that overshoot and
the step's set-up as bubble too. The ideal ratios to 1F1B's bubble are 0.5
(interleaved and looped BFS, v = 2), 1/3 (zero-bubble, input and weight
parts alike) and 1/6 (ZB-V on its V: the V's own fill, (n - 1) half-stage
forwards). There are 16 layers: 4 per stage, 2 per stage for the
schedules of 2 stages per lane.
\`simulated_peak_live_micro_batches_per_lane\` is counted on the plan;
\`lane_peak_kib\` is measured: the most one lane (one device) allocated
during a step above what it held before it (each stage copies its input
and the gradient coming back, so that the lane that holds them counts
them). The GELU gives those layers the memory that zero-bubble's claim
assumes (a micro-batch waiting for its weight part holds no more than one
waiting for its backward, as in a transformer layer): per layer the forward
keeps the GELU's input and the \`TimedLayer\`'s, a waiting weight part the
\`TimedLayer\`'s input and output gradient. On the real layers a waiting
weight part holds more (each Linear's input and output gradient, against
its input alone), so zero-bubble's later lanes hold more than 1F1B's
first. There \`peak_mib\` is the whole step's (all
lanes together) and \`lane_peak_mib\` the most one lane allocated above
what it held before the step (its activations and transients; parameters
and gradients, the same under every schedule, left out).

EOF
  table schedules
  cat <<EOF

## The planner (\`--only autotune\`, ${seconds[autotune]} s)

\`gpipe::autotune\` on 2 lanes of one thread, for the U-Net(2, 16) on 32
images of 3x64x64 and a conv-BN-ReLU CNN on 64 images of 3x32x32. The
memory limit is 0.8 of the peak of the choice made without a limit, which
rules that choice out. A grid of configurations that fit by the planner's
model (its 8 fastest, then every third, at least 12) is then measured:
step time (median) and, per lane, the most it allocated during a step
above what it held before, plus its parameters and gradients. The
summary holds the tuned choice's measured time over the grid's best, its
measured time over its prediction, whether each of its lanes stayed under
the limit, how many grid rows went over it when measured (the memory model
misses a few MiB at small micro-batches), and the tuning time. Gradients
are zeroed, not freed, between steps, so that they count once, with the
parameters.

EOF
  table autotune
  cat <<EOF

## Peak memory by checkpoint mode (\`--only memory\`, ${seconds[memory]} s)

16 x (Linear(256,256)+ReLU), batch 4096, 2 partitions, chunks 8: the
allocator's peak during a training step, above what was live before it.

EOF
  table memory
  cat <<EOF

## Per-cell overhead (\`--only overhead\`, ${seconds[overhead]} s)

16 x (Linear(64,64)+ReLU) at chunks 32, checkpoint never: the engine's
cost per cell over the plain model running the same micro-batches. The
one-partition row runs both steps on one CPU (Note [Paired steps on one
CPU] in \`bench/overhead.cpp\`).

EOF
  table overhead
  cat <<EOF

## Cost per cell (\`--only cell-cost\`, ${seconds[cell-cost]} s)

32 x Linear(64,64) in one partition, 32 micro-batches of 64 rows, forward
and backward, checkpoint never, one thread, both steps on one CPU: plain
and GPipe steps in alternation, per pair the difference over the 64 cells,
its median over 101 pairs, five runs. The \`vs plain fill-drain\` row
compares GPipe with the plain model run in fill-drain order (every forward,
then every backward), which holds every micro-batch's activations as GPipe
does: the runs above it include that memory traffic, that row is the
engine alone. The last row is \`train_step\` under 1F1B against the plain
model in the same order (see [benchmark-history](benchmark-history.md)).

EOF
  table cell-cost
  cat <<EOF

## Inference (\`--only inference\`, ${seconds[inference]} s)

Forward under \`InferenceMode\` of the speed model: the plain model on 1 and
2 threads, GPipe on 2 partitions at chunks 1, 4 and 8.

EOF
  table inference
  cat <<EOF

## Conv at chunks 1 (\`--only conv\`, ${seconds[conv]} s)

8 x (Conv2d(32,32,3,padding 1)+ReLU), batch 64 of 32x32: the plain model
against GPipe on 2 lanes at chunks 1 and 4, with the minor page faults per
step (Note [Lanes and glibc's malloc] in \`src/engine/lane.cpp\`; run with
\`GPIPE_MALLOC=system\` to see the lanes without that setting).

EOF
  table conv
  cat <<EOF

## What micro-batches cost (\`--only microbatch\`, ${seconds[microbatch]} s)

Why the speed model's step at m micro-batches on one lane is slower than
at one, without the engine: the plain model run as m micro-batches one
after the other on one thread, split into its matrix products (each
Linear's forward, input-gradient and weight-gradient products timed
alone, with their GFLOP/s), the gradient accumulation between
micro-batches (m - 1 adds per weight) and the rest (ReLU, bias, per-call
costs). Then two changes within reach: micro-batches whose rows are a
multiple of the kernel's blocking (time per sample at 24 to 65 rows), and
one weight-gradient product over the gathered micro-batches instead of m
products and their adds.

EOF
  table microbatch
  cat <<EOF

## Tracing cost (\`--only trace\`, ${seconds[trace]} s)

A training step with a \`gpipe::Trace\` recording against none, timed in
alternation, and the cost of one recorded event.

EOF
  table trace
  cat <<EOF

## Random numbers (\`--only random\`, ${seconds[random]} s)

The per-cell cost of giving each cell its own random stream (Note [Random
streams of concurrent cells] in \`src/random.h\`).

EOF
  table random
  cat <<EOF

## Distributed stages (\`gpipe-run -n 2 -- gpipe-bench --only dist\`, ${seconds[dist]} s)

Two processes on loopback (Gloo), one intra-op thread each:
\`PipelineStage\`'s training step against the single-process 2-lane GPipe
on the speed model, one gpipe message against a bare c10d send/recv of the
same tensor, and the timeline of one step (one row per rank; receive and
send waits drawn; [img/dist-trace.json](img/dist-trace.json) is the same
step as a Chrome trace, for Perfetto or chrome://tracing).
\`schedules_m32\`: every schedule at 32 micro-batches across the ranks
against the same plan on a lane per rank in one process, with the CPU time
a step takes in all (every thread of every process; the cores' count times
the step's wall time when they never stood idle).

EOF
  table dist
  cat <<EOF

![Distributed timeline](img/dist-trace.svg)

The same section on 4 ranks (\`gpipe-run -n 4\`, ${seconds[dist-4-ranks]} s;
four processes on this machine's cores):

EOF
  table dist-4-ranks
  cat <<EOF

![Distributed timeline on 4 ranks](img/dist-4-ranks-trace.svg)

## Replicas of a pipeline (\`gpipe-run -n 4 -- gpipe-bench --only mesh\`, ${seconds[mesh]} s)

Four processes on loopback, two replicas of a 2-stage pipeline
(\`Mesh(world, 2)\`), one intra-op thread each. \`all_reduce\`: the
gradient all-reduce of N bytes (16 tensors) through gpipe's buckets (kept
between steps, the gradients in them, averaged in place) against a bare
c10d all-reduce of one tensor of N bytes on the first stages' data group
(the other group waits), a sum (\`ratio\`), and against the same after a
product by 1/replicas, an average (\`ratio_to_bare_average\`: Gloo has no
averaging all-reduce, so an average takes one pass over the gradients), in
rounds (each side first in every third round; more rounds for fewer
bytes), the median of the rounds' ratios. \`overlap\`: 1F1B steps of
an MLP on the 2 x 2 mesh, traced; of the all-reduce time (from a stage's
first bucket's start, during its last B, to its last bucket's end), the
part during which a lane of the replica computed, with 64 rows a replica
(a stage's all-reduce takes longer than a micro-batch's backward, the
compute left to hide it) and with 256.

EOF
  table mesh
  cat <<EOF

## Training checkpoints (\`--only checkpoint\`, ${seconds[checkpoint]} s)

The speed tables' U-Net (B = 2, C = 16) on 2 partitions with Adam's two
moments: \`save_checkpoint\` (every file and the directory flushed to disk,
a checksum per file) and \`load_checkpoint\` (every file read and checked
against its checksum) per MiB of checkpoint, against \`torch::save\` and
\`torch::load\` of the same GPipe's weights alone (a zip archive, not
flushed); the median of gpipe-bench's --iters runs each.

EOF
  table checkpoint
} > "$page"
echo "== benchmarks.sh: wrote $page" >&2
