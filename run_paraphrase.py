"""Fine-tune GPT-2 for Quora paraphrase detection as a cloze ("yes" / "no" after a prompt), as the CS224N
paraphrase_detection.py does, and write para-{dev,test}-output.csv (`id \\t Predicted_Is_Paraphrase`, labels
8505 = yes, 3919 = no) into the run's folder (OUTPUT_DIR/predictions; `--predictions_dir predictions` for the
course's layout; an existing file is replaced only with --overwrite or --resume).

    # the course's run (official gpt2 weights; the course's Quora files)
    python run_paraphrase.py --para_train data/quora-train.csv --para_dev data/quora-dev.csv \\
        --para_test data/quora-test-student.csv --epochs 10 --lr 1e-5 --batch_size 8
    # the 20,214-pair subset here, split into 16,000 train / 4,212 dev (2 malformed rows skipped), small model
    python run_paraphrase.py --train data/quora/quora-dev-minbert.csv --split_dev 16000 --skip_bad_rows \\
        --model random:n_layer=4,n_head=4,n_embd=256 --lr 3e-4 --epochs 2 --batch_size 32 --bf16
    # continue an interrupted run exactly
    python run_paraphrase.py --train data/quora/quora-dev-minbert.csv --split_dev 16000 --skip_bad_rows --resume
    # data-parallel on 4 GPUs: each takes its slice of every batch of 32 (same weights as one process, batch 32)
    torchrun --standalone --nproc_per_node=4 run_paraphrase.py --use_gpu --batch_size 32 \\
        --para_train data/quora-train.csv --para_dev data/quora-dev.csv

The train/dev prompt and the test prompt are the course's (they differ; --test_prompt train uses the train prompt
for the test file too). Prompts longer than --max_length lose tokens on the left, so the question's end is kept.
Grade with `python -m tasks.evaluate --task para --pred checkpoints/paraphrase/predictions/para-dev-output.csv
--gold <dev file>`.
"""
import argparse
import os
import sys

from models.hub import data_dir, with_offline_help
from tasks.finetune import add_model_args, add_training_args, offline_recipe, run_cli
from tasks.lora import add_lora_args, check_lora_args
from tasks.paraphrase import MODES, ParaphraseConfig, run

# the offline hint's run of a few minutes: these flags join the user's own (offline_recipe), whose settings win
NO_HUB_RECIPE = [("--model", "random:n_layer=2,n_head=2,n_embd=128"),
                 ("--train", str(data_dir() / "quora" / "quora-dev-minbert.csv"), "--split_dev", "16000",
                  "--skip_bad_rows"),
                 ("--lr", "1e-3"), ("--epochs", "1"), ("--batch_size", "32"), ("--max_length", "64"), ("--threads", "1")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = parser.add_argument_group("model")
    g.add_argument("--fine-tune-mode", dest="fine_tune_mode", choices=MODES, default="full-model",
                   help="full-model (course): everything learns; last-linear-layer: only the tied output layer")
    add_model_args(g)
    g.add_argument("--tokenizer", default=None,
                   help="AutoTokenizer name or folder (default: the --model folder's own tokenizer when it holds one, "
                        "else gpt2: the HF cache, the hub, or offline data/gpt2-tokenizer)")
    g.add_argument("--max_length", type=int, default=None, help="truncate prompts to this many tokens "
                                                                "(default and maximum: the model's n_positions)")
    d = parser.add_argument_group("data")
    d.add_argument("--train", "--para_train", dest="train", default="data/quora-train.csv", help="training pairs")
    d.add_argument("--dev", "--para_dev", dest="dev", default=None,
                   help="dev pairs with labels (course: data/quora-dev.csv; or use --split_dev)")
    d.add_argument("--test", "--para_test", dest="test", default=None, help="test pairs without labels (optional)")
    d.add_argument("--split_dev", type=int, metavar="N", default=0,
                   help="no dev file: the first N examples of --train train, the rest are dev (deterministic)")
    d.add_argument("--predictions_dir", default=None,
                   help="folder of the prediction files, under the course's names (default: OUTPUT_DIR/predictions, "
                        "inside the run's folder; `--predictions_dir predictions` is the course's layout, what a "
                        "submission holds). An existing file is replaced only with --overwrite or --resume")
    d.add_argument("--dev_out", "--para_dev_out", dest="dev_out", default=None,
                   help="dev prediction file (default PREDICTIONS_DIR/para-dev-output.csv)")
    d.add_argument("--test_out", "--para_test_out", dest="test_out", default=None,
                   help="test prediction file (default PREDICTIONS_DIR/para-test-output.csv)")
    d.add_argument("--test_prompt", choices=("test", "train"), default="test",
                   help="prompt for the test file: the course's test prompt, or the train/dev one")
    d.add_argument("--skip_bad_rows", action="store_true", help="skip malformed rows (listed) instead of stopping")
    add_training_args(parser, epochs=10, batch_size=8, lr_help="learning rate (course: 1e-5)")
    add_lora_args(parser)
    return parser


def get_args(argv=None) -> ParaphraseConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_lora_args(parser, args)
    return ParaphraseConfig(**vars(args))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = get_args(argv)
    recipe = offline_recipe("run_paraphrase.py", build_parser, argv, NO_HUB_RECIPE)
    return run_cli(lambda: with_offline_help(lambda: run(cfg), recipe))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
