# Paper A's ablation at CPU scale on real text (WikiText-2: train on test.txt, evaluate on valid.txt).
# Every variant: same data, seed and budget (600 steps: the quick start's shape and budget, ~4 minutes on 2 cores). See README.
# python train.py config/ablation_cpu.py --readout raw --per_loop_ce --out_dir out-ablation/raw-perloop
dataset = "wikitext2"
data_dir = "../shared/data/wikitext-2"
tokenizer = "bytes"
n_embd, n_head, n_layer, n_loop = 128, 4, 2, 4
block_size = 128
dropout = 0.0
batch_size = 16
learning_rate = 2e-3
lr_schedule = "cosine"
warmup_iters = 50
min_lr = 2e-4
weight_decay = 0.01
max_iters = 600
log_interval = 10
eval_interval = 600
eval_iters = 10               # 10 x 16 x 128 = 20,480 validation tokens for the norm statistics
readout = "norm"
per_loop_ce = False
device = "cpu"
seed = 42
