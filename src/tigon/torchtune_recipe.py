"""torchtune's single-device full fine-tuning recipe with tigon:

    tune run $(python -c "import tigon.torchtune_recipe as r; print(r.__file__)") \\
        --config llama3_2/1B_full_single_device

takes any config of torchtune's ``full_finetune_single_device`` recipe unchanged. After torchtune
builds the model (weights loaded, activation checkpointing applied, layers marked for
torch.compile, which compiles at the first call), ``tigon.torchtune.patch`` patches it, and the
config's loss is replaced by ``tigon.torchtune.loss_for(model)`` with the same ``ignore_index``.
Everything else is torchtune's recipe.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from torchtune import config

import tigon.torchtune


def torchtune_recipe_module(name: str = "full_finetune_single_device"):
    """One of the recipe files torchtune installs (its ``recipes`` folder is not an importable
    package: ``tune run`` runs the files), loaded as a module."""
    spec = importlib.util.find_spec("recipes")  # finds the folder without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchtune's recipes folder was not found (is torchtune installed?)")
    path = os.path.join(list(spec.submodule_search_locations)[0], f"{name}.py")
    module_spec = importlib.util.spec_from_file_location(f"_torchtune_recipe_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


FullFinetuneRecipeSingleDevice = torchtune_recipe_module().FullFinetuneRecipeSingleDevice


class TigonFullFinetuneRecipeSingleDevice(FullFinetuneRecipeSingleDevice):
    """FullFinetuneRecipeSingleDevice whose model is patched by tigon and trained with tigon's loss."""

    def _setup_model(self, *args, **kwargs):
        model = super()._setup_model(*args, **kwargs)
        self.tigon_report = tigon.torchtune.patch(model)
        print(self.tigon_report, flush=True)
        return model

    def setup(self, cfg) -> None:
        super().setup(cfg)
        self._loss_fn = tigon.torchtune.loss_for(self._model, ignore_index=self._loss_fn.ignore_index)


@config.parse
def recipe_main(cfg) -> None:
    config.log_config(recipe_name="TigonFullFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = TigonFullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
