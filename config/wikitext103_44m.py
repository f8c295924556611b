# Paper A's 44M setting as its public code runs it (init: torch's defaults): WikiText-103, seq 256, K = 4, one GPU.
# Paper A uses its regex tokenizer (vocab 20,000): this builds 43,934,208 params, Paper A reports 43,935,234 (0.002% apart); GPT-2 BPE gives more.
dataset = "wikitext103"
tokenizer = "regex"
n_embd, n_head, n_layer, n_loops = 512, 8, 8, 4
block_size = 256
dropout = 0.1
batch_size = 64
learning_rate = 3e-4          # constant
lr_schedule = "constant"
weight_decay = 0.01
grad_clip = 1.0
epochs = 4                    # of 256-token windows every 128 tokens: each token twice an epoch
window_stride = 128
eval_interval = 2000
eval_iters = 40
per_loop_ce = True
readout = "norm"              # the failing baseline; --readout raw | final_norm, --norm_penalty 0.01 for the fixes
