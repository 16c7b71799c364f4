"""`pact`: one entry point grouping the stage commands (each also has its own pact-* script)."""

import click

from .calibrate import main as calibrate
from .convert import main as convert
from .demo import demo
from .eval import main as evaluate
from .export import main as export
from .generate import chat_cmd, generate_cmd
from .harness import main as lm_eval_cmd
from .push import main as push
from .train import main as train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """LoRA fine-tuning on NVFP4 frozen weights: convert, calibrate, train, eval, export, generate, chat."""


main.add_command(convert, "convert")
main.add_command(calibrate, "calibrate")
main.add_command(demo, "demo")
main.add_command(train, "train")
main.add_command(evaluate, "eval")
main.add_command(export, "export")
main.add_command(generate_cmd, "generate")
main.add_command(chat_cmd, "chat")
main.add_command(lm_eval_cmd, "lm-eval")
main.add_command(push, "push")

if __name__ == "__main__":
    main()
