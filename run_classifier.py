"""Fine-tune GPT-2 for sentiment classification on SST-5 and CFIMDB, as the CS224N classifier.py does, and write
the course's prediction files {mode}-{sst,cfimdb}-{dev,test}-out.csv (`id \\t Predicted_Sentiment`) into the run's
folder (OUTPUT_DIR/predictions; `--predictions_dir predictions` for the course's layout).

    # the course's run: SST then CFIMDB from data/ (the course layout) or else data/cs224n (bundled), official gpt2 weights
    python run_classifier.py --fine-tune-mode last-linear-layer --lr 1e-3
    python run_classifier.py --fine-tune-mode full-model --lr 1e-5
    # the same, writing predictions/ as the course's layout (what a submission holds)
    python run_classifier.py --fine-tune-mode full-model --lr 1e-5 --predictions_dir predictions
    # no hub: a small model from random init, SST then CFIMDB, one epoch each (a few minutes on a busy CPU)
    python run_classifier.py --model random:n_layer=2,n_head=2,n_embd=128 --fine-tune-mode full-model --lr 1e-3 \\
        --epochs 1 --batch_size 32 --max_length 64 --threads 1
    # one dataset, a small model trained from random init, bf16 on CPU
    python run_classifier.py --task sst --model random:n_layer=4,n_head=4,n_embd=256 --fine-tune-mode full-model \\
        --lr 3e-4 --epochs 3 --batch_size 32 --max_length 128 --bf16
    # own files (classes from --num_labels, or from 'sst' / 'cfimdb' in the file name)
    python run_classifier.py --train my-train.csv --dev my-dev.csv --test my-test.csv --num_labels 3
    # continue an interrupted run exactly; measure throughput over 200 steps
    python run_classifier.py --task sst --fine-tune-mode full-model --resume
    python run_classifier.py --task sst --fine-tune-mode full-model --model checkpoints/random-gpt2 --max_steps 200
    # data-parallel on 2 GPUs (or CPU processes with gloo): each takes its slice of every batch of 32
    torchrun --standalone --nproc_per_node=2 run_classifier.py --task sst --fine-tune-mode full-model --use_gpu \\
        --batch_size 32

--model takes a hub id, a folder in HF format (a pretrained run's output, a best/ checkpoint), a weights file, or
random:[PRESET,]key=value,... for random initialisation (vocabulary 50257, so the GPT-2 tokenizer fits).
An existing prediction file is replaced only with --overwrite or --resume. Without the hub, the default gpt2
tokenizer is the bundled copy (data/gpt2-tokenizer) after one probe of the hub; a --model folder holding a
tokenizer brings its own. Grade the files with `python -m tasks.evaluate --task sst --pred ... --gold ...`.
"""
import argparse
import os
import sys
from pathlib import Path

from models.hub import with_offline_help
from tasks.classifier import MODES, ClassifierConfig, run
from tasks.finetune import add_model_args, add_training_args, offline_recipe, run_cli
from tasks.lora import add_lora_args, check_lora_args

ROOT = Path(__file__).resolve().parent

# the offline hint's run of a few minutes: these flags join the user's own (offline_recipe), whose settings win
NO_HUB_RECIPE = [("--model", "random:n_layer=2,n_head=2,n_embd=128"), ("--fine-tune-mode", "full-model"),
                 ("--lr", "1e-3"), ("--epochs", "1"), ("--batch_size", "32"), ("--max_length", "64"), ("--threads", "1")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = parser.add_argument_group("model")
    g.add_argument("--fine-tune-mode", dest="fine_tune_mode", choices=MODES, default=None,
                   help="last-linear-layer (default): the GPT-2 body is frozen and only the head learns; full-model "
                        "(the default with --lora_rank): all learn")
    add_model_args(g)
    g.add_argument("--head_dropout", type=float, default=0.3,
                   help="dropout before the linear head (the course's classifier.py called this --hidden_dropout_prob)")
    g.add_argument("--tokenizer", default=None,
                   help="AutoTokenizer name or folder (default: the --model folder's own tokenizer when it holds one, "
                        "else gpt2: the HF cache, the hub, or offline data/gpt2-tokenizer)")
    g.add_argument("--max_length", type=int, default=None, help="truncate inputs to this many tokens "
                                                                "(default and maximum: the model's n_positions)")
    d = parser.add_argument_group("data")
    d.add_argument("--task", choices=("sst", "cfimdb", "both"), default=None,
                   help="course datasets to run (default: both, or the one named by --train)")
    d.add_argument("--data_dir", default=None, help="folder of ids-{sst,cfimdb}-{train,dev,test-student}.csv "
                                                     "(default: data/ in the course layout, else data/cs224n)")
    d.add_argument("--train", help="training file (instead of --task's)")
    d.add_argument("--dev", help="dev file with labels")
    d.add_argument("--test", help="test file without labels (optional with --train)")
    d.add_argument("--num_labels", type=int, help="number of classes (default: 5 for sst, 2 for cfimdb files)")
    d.add_argument("--predictions_dir", default=None,
                   help="folder of the prediction files, under the course's names (default: OUTPUT_DIR/predictions, "
                        "inside the run's folder; `--predictions_dir predictions` is the course's layout, what a "
                        "submission holds). An existing file is replaced only with --overwrite or --resume")
    d.add_argument("--dev_out", help="dev prediction file (default PREDICTIONS_DIR/{mode}-{task}-dev-out.csv)")
    d.add_argument("--test_out", help="test prediction file (default PREDICTIONS_DIR/{mode}-{task}-test-out.csv)")
    d.add_argument("--skip_bad_rows", action="store_true", help="skip malformed rows (listed) instead of stopping")
    add_training_args(parser, epochs=10, batch_size=8,
                      lr_help="learning rate (default: 1e-3 for last-linear-layer, 1e-5 for full-model, as the course)")
    add_lora_args(parser)
    return parser


def get_args(argv=None) -> ClassifierConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_lora_args(parser, args)
    return ClassifierConfig(**vars(args))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = get_args(argv)
    recipe = offline_recipe("run_classifier.py", build_parser, argv, NO_HUB_RECIPE)
    return run_cli(lambda: with_offline_help(lambda: run(cfg), recipe))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
