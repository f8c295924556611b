# The quick start: a looped LM on real text on 2 CPU cores, no download. With the default (Paper A's) init,
# per-loop CE and the norm readout, ‖H_K‖ jumps early in training far above the raw readout's (then
# settles; its log.jsonl): the blind spot's scale gap. --readout raw, the first fix, side by side
# (one seed: whether it is also the better model is the Paper A study's question, experiments/paper_a.md):
# python train.py config/cpu_tiny.py
# python train.py config/cpu_tiny.py --readout raw --out_dir out-cpu-tiny-raw
dataset = "pydoc"             # the Python docs that ship with CPython
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
eval_interval = 600            # once, at the end
eval_iters = 10
per_loop_ce = True
out_dir = "out-cpu-tiny"
seed = 1                      # experiments/quickstart.py adds --seed 1: the same run
device = "cpu"
sample_tokens = 300
