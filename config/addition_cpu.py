# Paper B's addition, scaled down for 2 CPU cores (2,000 steps a run; baseline ~8 min, STARS ~11):
# one shared sandwich block, d 128, 8 heads (Paper B's count), d_ff 512 GELU, input injected at every loop.
# 2,000 steps, not 800-1,600: shorter runs often stall on a loss plateau (README).
# python train.py config/addition_cpu.py                                   # baseline, fixed 4 loops
# python train.py config/addition_cpu.py --loop_sampling lognormal ...     # see README
task = "addition"
digits = 4
n_embd, n_head, n_layer, n_loops = 128, 8, 1, 4
mlp, mlp_hidden = "gelu", 512
block_norm = "sandwich"
init = "nanogpt"              # the README's CPU numbers were measured with it (Paper B's code: "normal")
inject = True
dropout = 0.0
readout = "norm"
batch_size = 256
max_iters = 2000
learning_rate = 1e-3
lr_schedule = "cosine"
warmup_iters = 50
min_lr = 1e-4
weight_decay = 0.01
loop_mu, loop_sigma, loop_max = 1.2, 0.5, 16   # median 3.3 loops: the baseline's compute
                                                  # (Paper B's mu 2, sigma 0.7 from step 0 did not learn in 800 steps at this size)
stars_warmup = 400            # 20% of training, as Paper B's 2k of 10k
eval_interval = 1000
eval_loops = 32
out_dir = "out-addition-cpu"
device = "cpu"
