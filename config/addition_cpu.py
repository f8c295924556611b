# Paper B's addition recipe, scaled down for 2 CPU cores: its block (one shared sandwich block, LayerNorm
# with biases, GELU MLP of width 2·d, 8 heads, explicit attention), its init (every weight N(0, 0.02)),
# dropout 0.1, no input injection, terminal loss through the final norm. Smaller: d 128 (Paper B: 512),
# 2,000 steps of 128 problems at learning rate 1e-3 (Paper B: 10k x 512 at 1e-4, on a GPU).
# python train.py config/addition_cpu.py                                     # baseline: fixed 4 loops
# python train.py config/addition_cpu.py --loop_sampling lognormal           # Paper B's depth sampling
# python train.py config/addition_cpu.py --loop_sampling lognormal --stars_lambda 0.1   # STARS
task = "addition"
digits = 4
n_embd, n_head, n_layer, n_loops = 128, 8, 1, 4
mlp, mlp_hidden = "gelu", 256
block_norm = "sandwich"
norm, bias = "layernorm", True
init = "normal"
inject = False
dropout = 0.1
readout = "norm"
batch_size = 128
max_iters = 2000
learning_rate = 1e-3
lr_schedule = "cosine"
warmup_iters = 100
min_lr = 0.0
weight_decay = 0.01
grad_clip = 0.0
# Paper B's depth distribution, LogNormal(2, 0.7), capped at 32 (Paper B: 100; P(t >= 32) = 1.9%), with
# the gradient through the last 4 loops only, so a deep step costs about as much as the baseline's
loop_mu, loop_sigma, loop_max, grad_loops = 2.0, 0.7, 32, 4
loop_start = 800              # a curriculum: 4 loops until step 800, then sampled depths (Paper B samples from
                              # step 0, which kept these short runs on the loss plateau: README)
stars_warmup = 1000           # the penalty once the depth is sampled (Paper B: 2k of 10k steps); from step 400
                              # it did better at depth 64 on seed 1 but kept seed 2 on the plateau (README)
eval_interval = 500
eval_loops = 100
out_dir = "out-addition-cpu"
device = "cpu"
