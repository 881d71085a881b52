"""Fine-tune GPT-2 on Shakespeare's sonnets and complete held-out sonnets from their first 3 lines, as the CS224N
sonnet_generation.py does; write generated_sonnets.txt (and generated_sonnets_dev.txt) in the course's format into
the run's folder (OUTPUT_DIR/predictions; `--predictions_dir predictions` for the course's layout; an existing file
is replaced only with --overwrite, or --resume in a run that trains) and grade the dev completions with chrF
(sacrebleu CHRF() defaults, prompt lines included) after every epoch and at the end. Runs that do not train default to their own folders:
checkpoints/sonnet-generate-{greedy,sample,beamN}[-int8|-int4] and checkpoints/sonnet-baseline-{prompts,random_sonnet-seedS}.

    # the course's run: official gpt2 weights, 10 epochs, batch 8, lr 1e-5, sampling at temperature 1.2, top-p 0.9
    python run_sonnet.py --use_gpu
    # a model pretrained here by run_pretrain.py (a folder with its tokenizer), fp32 on a busy CPU
    python run_sonnet.py --model checkpoints/shakespeare-bpe-4x256/best --tokenizer data/gpt2-tokenizer \\
        --lr 3e-4 --epochs 10 --threads 1 --output_dir checkpoints/sonnet-4x256
    # decode the fine-tuned model again, greedily or with beam search (no training; best/ holds its tokenizer;
    # files in checkpoints/sonnet-generate-greedy/predictions and checkpoints/sonnet-generate-beam4/predictions)
    python run_sonnet.py --generate_only --model checkpoints/sonnet-4x256/best --greedy --repetition_penalty 1.2
    python run_sonnet.py --generate_only --model checkpoints/sonnet-4x256/best --num_beams 4
    # the same greedy decoding with weight-only int8 weights, one prompt at a time (sonnet-generate-greedy-int8)
    python run_sonnet.py --generate_only --model checkpoints/sonnet-4x256/best --greedy --quantize int8
    # baselines graded the same way: the prompts alone; prompts + lines 4-14 of a random training sonnet
    python run_sonnet.py --baseline prompts
    python run_sonnet.py --baseline random_sonnet --seed 1
    # data-parallel on 2 GPUs (rank 0 alone generates the dev sonnets and writes files)
    torchrun --standalone --nproc_per_node=2 run_sonnet.py --use_gpu --batch_size 8

Data files default to data/ (the course layout) or else data/cs224n (bundled). Every sonnet of the training file
ends with EOS, so the model learns to stop; generation stops each sonnet at EOS or after --max_new_tokens.
Grade a file again with `python -m tasks.evaluate --task sonnet --pred FILE --gold TRUE_sonnets_held_out_dev.txt`.
"""
import argparse
import os
import sys
from pathlib import Path

from models.hub import with_offline_help
from modules.quant import QUANTIZE_MODES
from tasks.finetune import add_model_args, add_training_args, offline_recipe, run_cli
from tasks.lora import add_lora_args, check_lora_args
from tasks.sonnet import SonnetConfig, course_file, run

ROOT = Path(__file__).resolve().parent

# the offline hint's run of a few minutes: these flags join the user's own (offline_recipe), whose settings win
NO_HUB_RECIPE = [("--model", "random:n_layer=2,n_head=2,n_embd=128"), ("--lr", "1e-3"), ("--epochs", "3"),
                 ("--max_new_tokens", "64"), ("--threads", "1")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = parser.add_argument_group("model")
    add_model_args(g, "hub id, HF folder (e.g. a run_pretrain.py checkpoint), weights file, or random:key=value,...")
    g.add_argument("--tokenizer", default=None,
                   help="AutoTokenizer name or folder (default: the --model folder's own tokenizer when it holds one, "
                        "else gpt2: the HF cache, the hub, or offline data/gpt2-tokenizer)")
    g.add_argument("--max_length", type=int, default=None,
                   help="cut training sonnets to this many tokens (default and maximum: the model's n_positions)")
    d = parser.add_argument_group("data")
    d.add_argument("--sonnet_path", default=course_file("sonnets.txt"), help="training sonnets")
    d.add_argument("--held_out_sonnet_path", default=course_file("sonnets_held_out.txt"),
                   help="prompts (first 3 lines) to complete into --sonnet_out")
    d.add_argument("--predictions_dir", default=None,
                   help="folder of the prediction files, under the course's names (default: OUTPUT_DIR/predictions, "
                        "inside the run's folder; `--predictions_dir predictions` is the course's layout, what a "
                        "submission holds). An existing file is replaced only with --overwrite (or --resume, in a "
                        "run that trains)")
    d.add_argument("--sonnet_out", default=None,
                   help="completions of the held-out prompts (default PREDICTIONS_DIR/generated_sonnets.txt)")
    d.add_argument("--dev_sonnet_path", default=course_file("sonnets_held_out_dev.txt"), help="dev prompts")
    d.add_argument("--dev_gold_path", default=course_file("TRUE_sonnets_held_out_dev.txt"),
                   help="the dev sonnets in full, for chrF")
    d.add_argument("--dev_out", default=None,
                   help="completions of the dev prompts (default PREDICTIONS_DIR/generated_sonnets_dev.txt)")
    dec = parser.add_argument_group("decoding")
    dec.add_argument("--temperature", type=float, default=1.2, help="softmax temperature of sampling (course: 1.2)")
    dec.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling mass in (0, 1] (course: 0.9)")
    dec.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    dec.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    dec.add_argument("--num_beams", type=int, default=1,
                     help="> 1: beam search (deterministic: temperature, top-p and top-k do not apply)")
    dec.add_argument("--length_penalty", type=float, default=1.0,
                     help="beam search: score = log-prob / length ** this (> 0 favours longer sonnets)")
    dec.add_argument("--repetition_penalty", type=float, default=1.0,
                     help="> 1 makes tokens already in the sonnet less likely (CTRL-style)")
    dec.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated after each prompt (course: 128)")
    dec.add_argument("--quantize", choices=QUANTIZE_MODES,
                     help="with --generate_only: decode with int8 or int4 copies of the weights (w8a8 / w4a8: "
                          "and int8 activations), one prompt at a time (close to, not equal to, the model's own "
                          "output; all but int8 need inputs of multiples of 32)")
    m = parser.add_argument_group("mode")
    m.add_argument("--generate_only", action="store_true",
                   help="no fine-tuning: complete the prompts with --model as it is (e.g. a best/ checkpoint)")
    m.add_argument("--baseline", choices=("prompts", "random_sonnet"),
                   help="no model: write and grade the prompts alone, or each followed by lines 4-14 of a random "
                        "training sonnet (chosen with --seed)")
    add_training_args(parser, epochs=10, batch_size=8, lr_help="learning rate (course: 1e-5)")
    add_lora_args(parser)
    return parser


def get_args(argv=None) -> SonnetConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_lora_args(parser, args)
    if args.num_beams < 1 or args.max_new_tokens < 1:
        parser.error("--num_beams and --max_new_tokens must be at least 1")
    if args.quantize and not args.generate_only:
        parser.error("--quantize applies to --generate_only (training's dev generations keep the model's weights)")
    if args.quantize and args.num_beams > 1:
        parser.error("--quantize applies to greedy and sampled decoding, not to beam search (--num_beams > 1)")
    if not 0 < args.top_p <= 1 or args.temperature <= 0 or args.top_k < 0 or args.repetition_penalty <= 0:
        parser.error("need 0 < --top_p <= 1, --temperature > 0, --top_k >= 0 and --repetition_penalty > 0")
    return SonnetConfig(**vars(args))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = get_args(argv)
    recipe = offline_recipe("run_sonnet.py", build_parser, argv, NO_HUB_RECIPE)
    return run_cli(lambda: with_offline_help(lambda: run(cfg), recipe))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
