# Paper B's addition setting as its public code runs it (train_addition/), for a GPU: 4-digit addition, answer
# reversed, one shared sandwich block (d 512, 8 heads, d_ff 1024 GELU), no input injection (the state starts at
# the embedding and the block is looped), dropout 0.1, every weight N(0, 0.02), batch 512, 10k steps, AdamW 1e-4,
# 2k warm-up then cosine to 0, no gradient clipping. Baseline: fixed 4 loops (this file as is).
# STARS: --stars_lambda 0.1 --loop_sampling lognormal (mu 2, sigma 0.7, loop_max 100).
task = "addition"
digits = 4
n_embd, n_head, n_layer, n_loops = 512, 8, 1, 4
mlp, mlp_hidden = "gelu", 1024
block_norm = "sandwich"
norm, bias = "layernorm", True
init = "normal"
inject = False
dropout = 0.1
readout = "norm"
batch_size = 512
max_iters = 10000
learning_rate = 1e-4
lr_schedule = "cosine"
warmup_iters = 2000
min_lr = 0.0
weight_decay = 0.01
grad_clip = 0.0
loop_mu, loop_sigma, loop_max = 2.0, 0.7, 100
stars_warmup = 2000
eval_interval = 1000
eval_loops = 100
out_dir = "out-addition"
