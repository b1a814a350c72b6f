"""Which attention recipe each decoder layer runs: the one place a model's config becomes recipes.

Both attention paths read it: the paged engine (:class:`~flexpage.model.runner.ModelRunner`
builds the list once per model) and the HF backend (``attn_implementation="flexpage"``, which
maps each call's HF keyword arguments through :func:`recipe_for`). A user's recipe replaces
the model's (``LLM(recipe=...)``, ``EngineConfig.recipe``, ``flexpage serve --recipe``): one
recipe for every layer, one per layer kind (``{"sliding_attention": ...}``: HF's ``layer_types``
names; the other kinds keep the model's), or one per layer. The block manager's layer groups follow the
chosen recipes' declared ``window``, so a recipe that never looks back far releases blocks
whatever the model's config says.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from flexpage.attention.recipe import CAUSAL, Recipe, compose
from flexpage.core.layer_groups import layer_windows

#: what a user may pass as a recipe: a Recipe, ``"module:attr"`` / ``"path/file.py[:attr]"``,
#: one of those per layer kind (a mapping from :data:`LAYER_KINDS`), or one per layer
RecipeChoice = Union[Recipe, str, Mapping[str, Union[Recipe, str]], Sequence[Union[Recipe, str]], None]

#: the layer kinds a recipe choice may name (HF's ``layer_types`` vocabulary)
LAYER_KINDS = ("full_attention", "sliding_attention")

__all__ = ["LAYER_KINDS", "RecipeChoice", "engine_recipes", "load_recipe", "model_recipes", "parse_recipe_option",
           "recipe_for"]


_RECIPES_BY_CHOICE: dict[tuple[int | None, float | None], Recipe] = {}


def recipe_for(sliding_window: int | None, softcap: float | None) -> Recipe:
    """The recipe HF's attention keyword arguments ask for (cached: one object per choice, so
    a model's layers share compiled kernels). The cache is a plain dict, not ``functools``:
    the HF backend calls this inside a user's compiled model, whose trace reads a filled dict
    as a constant (Dynamo traces through ``functools`` caches, and warns that it does)."""
    key = (sliding_window, softcap)
    if key not in _RECIPES_BY_CHOICE:
        from flexpage.recipes.sliding_window import sliding_window as window_recipe
        from flexpage.recipes.softcap import softcap as softcap_recipe

        parts = [CAUSAL]
        if sliding_window:
            parts.append(window_recipe(int(sliding_window)))
        if softcap:
            parts.append(softcap_recipe(float(softcap)))
        _RECIPES_BY_CHOICE[key] = parts[0] if len(parts) == 1 else compose(*parts)
    return _RECIPES_BY_CHOICE[key]


def model_recipes(config: Any) -> tuple[Recipe, ...]:
    """One recipe per decoder layer, as the HF config describes the model's attention.

    Causal everywhere, plus each layer's sliding window (``layer_types`` / ``sliding_window``)
    and Gemma2's ``attn_logit_softcapping``; Bloom computes ALiBi in its own attention
    module, so its layers get :func:`~flexpage.recipes.alibi.alibi`.
    """
    text_config = _text_config(config)
    if getattr(config, "model_type", None) == "bloom":
        from flexpage.recipes.alibi import alibi

        return (alibi(int(config.n_head)),) * int(text_config.num_hidden_layers)
    softcap = getattr(text_config, "attn_logit_softcapping", None)
    return tuple(recipe_for(window, softcap) for window in layer_windows(text_config))


def load_recipe(spec: str) -> Recipe:
    """A recipe named on the command line: ``"package.module:attr"`` or ``"path/to/file.py[:attr]"``.

    ``attr`` is a :class:`Recipe` or a function called with no arguments that returns one;
    a file without ``:attr`` must define exactly one module-level Recipe.
    """
    return load_object(spec, Recipe, "recipe")


def load_object(spec: str, cls: type, what: str) -> Any:
    """An instance of ``cls`` named on the command line (see :func:`load_recipe`); errors name ``what``."""
    kind = cls.__name__
    target, _, attr = spec.partition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{what}: {spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"flexpage_user_{what.replace(' ', '_')}_{path.stem}",
                                                             path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        if not attr:
            raise ValueError(f"{what}: got {spec!r}, expected 'package.module:attr' or 'path/to/file.py[:attr]'")
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ValueError(f"{what}: {spec!r}: cannot import {target!r} ({error})") from error
    if not attr:
        found = [value for value in vars(module).values() if isinstance(value, cls)]
        if len(found) != 1:
            raise ValueError(f"{what}: {spec!r} defines {len(found)} {kind} objects; name one as {target}:attr")
        return found[0]
    if not hasattr(module, attr):
        raise ValueError(f"{what}: {spec!r}: {target} has no attribute {attr!r}")
    value = getattr(module, attr)
    made = value
    if callable(value) and not isinstance(value, cls):
        try:
            made = value()
        except TypeError as error:
            raise ValueError(f"{what}: {spec!r} takes arguments ({error}); name a {kind} made with them") from error
    if not isinstance(made, cls):
        raise ValueError(f"{what}: {spec!r} gave a {type(made).__name__}, expected a {kind} "
                         "(or a function of no arguments returning one)")
    return made


def engine_recipes(choice: RecipeChoice, config: Any) -> tuple[Recipe, ...]:
    """The recipe of every decoder layer: the model's own (``choice`` None), one recipe for all
    layers, one per layer kind, or one per layer."""
    recipes = model_recipes(config)
    if choice is None:
        return recipes
    if isinstance(choice, (Recipe, str)):
        return (_as_recipe(choice),) * len(recipes)
    if isinstance(choice, Mapping):
        text_config = _text_config(config)
        kinds = [LAYER_KINDS[window is not None] for window in layer_windows(text_config)]
        unknown = sorted(set(choice) - set(kinds))
        if unknown:
            raise ValueError(f"recipe: no layer of this model is {', '.join(map(repr, unknown))}; its layers are "
                             f"{', '.join(sorted(set(kinds)))}")
        chosen_by_kind = {kind: _as_recipe(value) for kind, value in choice.items()}
        return tuple(chosen_by_kind.get(kind, recipe) for kind, recipe in zip(kinds, recipes))
    chosen = tuple(_as_recipe(c) for c in choice)
    if len(chosen) != len(recipes):
        raise ValueError(f"recipe: got {len(chosen)} recipes, expected one for all layers or one per layer "
                         f"({len(recipes)})")
    return chosen


def parse_recipe_option(values: Sequence[str] | None) -> RecipeChoice:
    """The recipe choice of a repeatable command-line option: none, one ``spec`` for every
    layer, or ``kind=spec`` pairs (e.g. ``--recipe sliding_attention=recipes/chunked_local.py``)."""
    if not values:
        return None
    pairs = [value.partition("=") for value in values]
    for kind, sep, _ in pairs:
        if sep and kind.isidentifier() and kind not in LAYER_KINDS:
            raise ValueError(f"recipe: unknown layer kind {kind!r} in {kind}=...; kinds: {', '.join(LAYER_KINDS)}")
    by_kind = [(kind, spec) for kind, sep, spec in pairs if sep and kind in LAYER_KINDS]
    if not by_kind and len(values) == 1:
        return values[0]
    if len(by_kind) != len(values):
        raise ValueError(f"recipe: got {list(values)}; give one recipe for every layer, or KIND=RECIPE for each "
                         f"kind to change (kinds: {', '.join(LAYER_KINDS)})")
    kinds = [kind for kind, _ in by_kind]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"recipe: a layer kind is named twice in {list(values)}")
    return dict(by_kind)


def _text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _as_recipe(choice: Recipe | str) -> Recipe:
    if isinstance(choice, Recipe):
        return choice
    if isinstance(choice, str):
        return load_recipe(choice)
    raise ValueError(f"recipe: got a {type(choice).__name__}, expected a Recipe or 'module:attr'")
