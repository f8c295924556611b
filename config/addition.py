# Paper B's addition setting (SPEC §2), for a GPU: 4-digit addition, answer reversed,
# one shared sandwich block (d 512, 8 heads, d_ff 1024 GELU), batch 512, 10k steps,
# AdamW 1e-4 cosine with 2k warm-up. Baseline: fixed 4 loops (this file as is).
# STARS: --stars 0.1 --loop_sampling lognormal (mu 2, sigma 0.7, loop_max 100).
task = "addition"
digits = 4
n_embd, n_head, n_layer, n_loop = 512, 8, 1, 4
mlp, mlp_hidden = "gelu", 1024
block_norm = "sandwich"
inject = True
dropout = 0.0
readout = "norm"
batch_size = 512
max_iters = 10000
learning_rate = 1e-4
lr_schedule = "cosine"
warmup_iters = 2000
min_lr = 1e-5
weight_decay = 0.01
loop_mu, loop_sigma, loop_max = 2.0, 0.7, 100
stars_warmup = 2000
eval_interval = 1000
eval_loops = 100
out_dir = "out-addition"
