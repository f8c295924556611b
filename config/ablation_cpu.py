# Paper A's ablation at CPU scale on real text: WikiText-2 as bytes (train on the small test split, evaluate
# on valid), Paper A's recipe otherwise: torch's default init, constant LR with no warm-up, AdamW wd 0.01,
# clip 1.0, windows every half-window in shuffled epochs. Eleven rows of it on three seeds, with each run's time:
# experiments/paper_a.md.
# python train.py config/ablation_cpu.py --readout raw --per_loop_ce --out_dir out-ablation/raw-perloop
# (offline: add --data_dir DIR, a folder holding WikiText-2's valid.txt and test.txt)
dataset = "wikitext2"
train_split = "test"
tokenizer = "bytes"
n_embd, n_head, n_layer, n_loops = 128, 4, 2, 4
block_size = 128
window_stride = 64
dropout = 0.0
init = "pytorch"
batch_size = 16
learning_rate = 2e-3          # the paper's 3e-4 is for 4 epochs of WikiText-103; 600 steps need more (lr3e-4 row)
lr_schedule = "constant"
weight_decay = 0.01
max_iters = 600
log_interval = 10
eval_interval = 600
eval_iters = 10               # 10 x 16 x 128 = 20,480 validation tokens for the norm statistics
readout = "norm"
per_loop_ce = False
device = "cpu"
seed = 1                      # the study's first seed (it adds --seed S)
