# The depth study on text (experiments/depth.py): WikiText-2 as bytes (train on the small test split,
# evaluate on valid), the CPU language shape, 600 steps, evaluated at every depth 1..64.
dataset = "wikitext2"
train_split = "test"
tokenizer = "bytes"
n_embd, n_head, n_layer, n_loops = 128, 4, 2, 4
block_size = 128
dropout = 0.0
batch_size = 16
learning_rate = 2e-3
lr_schedule = "cosine"
warmup_iters = 50
min_lr = 2e-4
max_iters = 600
log_interval = 20
eval_interval = 600
eval_iters = 10               # 10 x 16 x 128 = 20,480 validation bytes, the same for every recipe and depth
eval_loops = 64
per_loop_ce = True
out_dir = "out-depth"
device = "cpu"
init = "normal"             # Paper B's N(0, 0.02) (torch's defaults, Paper A's: --init pytorch)
seed = 1                      # the study's first seed (it adds --seed S)
# the recipe: depth sampled from LogNormal(1.14, 0.7) capped at 32 (mean 4.0 loops, the baseline's compute), with
# backprop through every loop (the fixed-depth baseline: --loop_sampling fixed)
loop_sampling = "lognormal"
loop_mu, loop_sigma, loop_max = 1.14, 0.7, 32
