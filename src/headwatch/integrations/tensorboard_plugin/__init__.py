"""The headwatch tab of TensorBoard: a plugin installed with the package.

TensorBoard finds it through the ``tensorboard_plugins`` entry point (``pyproject.toml``) and shows it as
the **HEADWATCH** tab, in an iframe that loads the plugin's own ES module (``static/index.js``, with
``static/style.css``: no script or style from the network). The page reads everything through the routes
below, which read through the ``DataProvider`` TensorBoard hands the plugin (no event file is opened), and
reloads with TensorBoard (its reload button and timer) or every 30 s when opened alone
(``/data/plugin_entry.html?name=headwatch``).

Routes, under ``/data/plugin/headwatch/`` (JSON; every run argument is a TensorBoard run name):

- ``runs``: the runs with headwatch tags, their prefix and which optional sections they have;
- ``vitals?run=R``: the vital signs of :data:`headwatch.tensorboard.charts.PANELS`, every point unsmoothed;
- ``alerts?run=R``: the alerts on the run's timeline, with their messages;
- ``collisions?run=R``: the collision tables, decoded tokens and their nearest rows, every measurement;
- ``verdicts?run=R&run=S...``: ``headwatch report``'s verdicts for those runs (default: every headwatch run),
  grouped as the report groups them, when :func:`headwatch.report.verdicts` exists (:mod:`.verdicts`).

Importing this module imports neither torch nor Lightning (TensorBoard imports it at start).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

PLUGIN_NAME = "headwatch"
_STATIC = {"/index.js": ("index.js", "text/javascript"), "/style.css": ("style.css", "text/css")}


def _respond(request: Any, payload: Any, code: int = 200) -> Any:
    body = json.dumps(payload, allow_nan=False, ensure_ascii=False)
    return http_util.Respond(request, body, "application/json", code=code)


class HeadwatchPlugin(base_plugin.TBPlugin):
    """TensorBoard's headwatch tab (module docstring).

    Args:
        context: the ``TBContext`` TensorBoard builds; its ``data_provider`` is the only data source, its
            ``logdir`` locates the runs' ``hparams.yaml`` and ``headwatch_alerts.jsonl`` for the verdicts.
    """

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider
        self._logdir = context.logdir or (getattr(context.flags, "logdir", None) if context.flags else None)

    def get_plugin_apps(self) -> dict[str, Any]:
        apps: dict[str, Any] = {route: self._static for route in _STATIC}
        apps.update({"/runs": self._runs, "/vitals": self._vitals, "/alerts": self._alerts,
                     "/collisions": self._collisions, "/verdicts": self._verdicts})  # fmt: skip
        return apps

    def is_active(self) -> bool:
        return False  # the tab shows when the experiment has scalars (data_plugin_names): no listing here

    def data_plugin_names(self) -> tuple[str, ...]:
        return ("scalars",)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="headwatch")

    # ------------------------------------------------------------------ routes
    @wrappers.Request.application
    def _static(self, request: Any) -> Any:
        name, mime = _STATIC[request.path[request.path.rindex("/") :]]
        content = resources.files(__package__).joinpath("static", name).read_bytes()
        return http_util.Respond(request, content, mime)

    def _context(self, request: Any) -> tuple[Any, str]:
        from tensorboard import plugin_util

        return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)

    @wrappers.Request.application
    def _runs(self, request: Any) -> Any:
        from headwatch.integrations.tensorboard_plugin import data, verdicts

        ctx, eid = self._context(request)
        return _respond(request, {"runs": data.list_runs(self._provider, ctx, eid), "verdicts": True})

    def _one_run(self, request: Any, read: Any) -> Any:
        run = request.args.get("run")
        if not run:
            return _respond(request, {"error": "give a run: ?run=<TensorBoard run name>"}, code=400)
        ctx, eid = self._context(request)
        return _respond(request, read(self._provider, ctx, eid, run))

    @wrappers.Request.application
    def _vitals(self, request: Any) -> Any:
        from headwatch.integrations.tensorboard_plugin import data

        return self._one_run(request, data.vitals)

    @wrappers.Request.application
    def _alerts(self, request: Any) -> Any:
        from headwatch.integrations.tensorboard_plugin import data

        return self._one_run(request, data.alerts)

    @wrappers.Request.application
    def _collisions(self, request: Any) -> Any:
        from headwatch.integrations.tensorboard_plugin import data

        return self._one_run(request, data.collisions)

    @wrappers.Request.application
    def _verdicts(self, request: Any) -> Any:
        from headwatch.integrations.tensorboard_plugin import data, verdicts

        ctx, eid = self._context(request)
        runs = request.args.getlist("run") or [r["run"] for r in data.list_runs(self._provider, ctx, eid)]
        return _respond(request, verdicts.verdicts(self._provider, ctx, eid, self._logdir, runs))
