"""The config a memory plan is made for: ``load_config`` takes a config object, a built model, a
shape name of tigon.shapes, a folder or config.json path, or a hub id (only its config.json is
fetched, from the local cache when the hub does not answer); ``check_causal_lm`` refuses a config
with no causal LM. A model argument that gives no config raises ConfigError, one line for the user.
"""

from __future__ import annotations

import os
import re

from torch import nn

from tigon.extras import require_extra
from tigon.shapes import SHAPES, shape_config


class ConfigError(ValueError):
    """A model argument that gives no config to plan: a path that does not exist, a folder
    without config.json, a file that is not a model's config, an unknown shape name, a hub id
    the hub (offline: the local cache) does not have, or a config with no causal LM. Its message
    is one line for the user (``tigon`` prints it as the model argument's error)."""


# A hub id: namespace/name (huggingface.co/<namespace>/<name>). A name without a namespace is a
# shape name or an error, never a hub lookup: a typo of a shape fails at once, offline.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# How long the check that the hub answers may wait before a hub id is looked up in the local
# cache only (huggingface_hub retries a failing request for about 25 s).
HUB_PROBE_TIMEOUT_S = 5.0
_MODEL_FORMS = "a shape name, a folder with config.json, a config.json or a hub id like meta-llama/Llama-3.2-1B"


def load_config(model_or_config):
    """A transformers config from a config object, a built model, a shape name of
    tigon.shapes (offline), a folder or config.json path, or a hub id ``namespace/name``
    (only its config.json is fetched; from the local cache when HF_HUB_OFFLINE is set or the
    hub does not answer). A name that gives no config raises ConfigError."""
    require_extra("hf", "tigon's memory planner")
    from transformers import PretrainedConfig

    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    if isinstance(model_or_config, nn.Module) and hasattr(model_or_config, "config"):
        return model_or_config.config
    if isinstance(model_or_config, str) and model_or_config in SHAPES:
        return shape_config(model_or_config)
    if not isinstance(model_or_config, (str, os.PathLike)):
        raise TypeError(f"model must be a transformers config, a model, a config path or a hub id, "
                        f"got {type(model_or_config).__name__}")
    name = os.fspath(model_or_config)
    path = os.path.expanduser(name)
    if name and os.path.exists(path):
        return _local_config(path)
    if isinstance(model_or_config, str) and _HUB_ID.fullmatch(name):
        return _hub_config(name)
    if not name or isinstance(model_or_config, os.PathLike) or "/" in name or os.sep in name \
            or name.startswith((".", "~")) or name.endswith(".json"):
        raise ConfigError(f"no such file or folder: {name!r}; give {_MODEL_FORMS}")
    raise ConfigError(f"unknown shape {name!r} (choose from {', '.join(map(repr, SHAPES))}), or give a folder "
                      f"with config.json, a config.json or a hub id with its namespace, like meta-llama/Llama-3.2-1B")


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _local_config(path: str):
    """The config in ``path``: a folder holding config.json, or a config file."""
    import json

    import transformers
    from huggingface_hub import errors as hub_errors
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    folder = os.path.isdir(path)
    file = os.path.join(path, "config.json") if folder else path
    if not os.path.isfile(file):
        raise ConfigError(f"{path} has no config.json; give {_MODEL_FORMS}" if folder else
                          f"{path} is not a file or a folder")
    try:
        with open(file, "rb") as f:
            data = json.loads(f.read())
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{file} is not valid JSON ({_one_line(exc)})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file} holds a JSON {type(data).__name__}, not a model's config (an object with a "
                          f"\"model_type\")")
    model_type = data.get("model_type")
    if not model_type:
        raise ConfigError(f"{file} has no \"model_type\" (the model's family, e.g. \"llama\"): is it a "
                          f"transformers model's config.json?")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{file}: model_type {model_type!r} is not a model family transformers "
                          f"{transformers.__version__} knows")
    refused = (ValueError, TypeError, getattr(hub_errors, "StrictDataclassError", ValueError))
    try:  # transformers checks the values (types, ranges) as it builds the config
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(file))
                                          if os.path.basename(file) == "config.json" else file)
    except refused as exc:
        raise ConfigError(f"{file}: transformers refuses the config: {_one_line(exc)}") from exc


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub read it at import, or as set since."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(f and f.strip().upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _hub_unreachable() -> str | None:
    """Why the hub (or the proxy to it) takes no connection within HUB_PROBE_TIMEOUT_S; None when it does."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxy = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxy.hostname, proxy.port or (443 if proxy.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:  # socket.gaierror (no DNS), TimeoutError, ConnectionRefusedError, ...
        return f"{host}:{port}: {exc.strerror or str(exc) or type(exc).__name__}"
    return None


def _hub_config(repo_id: str):
    """The config of the hub repository ``repo_id``: downloaded (or refreshed) when the hub
    answers, else from the local cache."""
    from huggingface_hub import errors, hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except errors.HFValidationError as exc:
        raise ConfigError(f"{repo_id!r} is not a folder here nor a valid hub id ({_one_line(exc)})") from exc
    cached = cached if isinstance(cached, str) else None
    offline = _hub_offline()
    unreachable = None if offline else _hub_unreachable()
    if offline or unreachable:
        if cached is None:
            why = "HF_HUB_OFFLINE is set: unset it to download the config" if offline else \
                f"the hub does not answer ({unreachable}): check the connection"
            raise ConfigError(f"{repo_id!r} is not a folder here nor in the hub cache, and {why}, or give a folder "
                              f"with config.json")
        file = cached
    else:
        try:
            file = hf_hub_download(repo_id, "config.json")
        except errors.GatedRepoError as exc:
            raise ConfigError(f"{repo_id} is gated on the hub: accept its terms at https://huggingface.co/{repo_id} "
                              f"and log in (`hf auth login`)") from exc
        except errors.RepositoryNotFoundError as exc:
            raise ConfigError(f"{repo_id!r} is not a folder here nor a model on the hub (a private one needs "
                              f"`hf auth login`)") from exc
        except errors.LocalEntryNotFoundError as exc:  # the download failed and nothing is cached
            raise ConfigError(f"could not download {repo_id}'s config.json from the hub: {_one_line(exc)}") from exc
        except errors.EntryNotFoundError as exc:
            raise ConfigError(f"{repo_id} on the hub has no config.json (is it a transformers model?)") from exc
        except errors.HfHubHTTPError as exc:
            raise ConfigError(f"the hub refused {repo_id}'s config.json: {_one_line(exc)}") from exc
    config = _local_config(file)
    config._name_or_path = repo_id
    return config


def check_causal_lm(config) -> None:
    """ConfigError unless transformers has a causal LM (AutoModelForCausalLM) for ``config``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"the planner predicts causal language models (AutoModelForCausalLM); model_type "
                          f"{config.model_type!r} is not one (vision-language models are not planned yet)")
