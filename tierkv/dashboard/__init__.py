"""The web dashboard: live charts of a running TieredLLM or of a recorded JSONL, or a static report.

Primitives: `dashboard_app`, `serve`, `static_page`, `write_report` (stdlib only; the charting
library, uPlot, is vendored under static/vendor).
"""
from tierkv.dashboard.app import dashboard_app, serve
from tierkv.dashboard.page import static_page, write_report

__all__ = ["dashboard_app", "serve", "static_page", "write_report"]
