"""The plotly.js the dashboard and the report load: plotly's partial "cartesian" bundle (1.5 MB minified) instead of
the full one plotly.py ships (4.6 MB), when both are the same plotly.js version.

The figures draw three trace types only (``TRACE_TYPES``: scatter, bar, heatmap; tests/dashboards check that every
figure of every page and of the report draws with this bundle in Chromium), so the full bundle's 3D, map, polar,
financial and table traces were parsed and run on every page load for nothing (Chromium's script time of the
overview's first visit: 1.8-2.3x less with this one; benchmarks/README.md).

The bundle is vendored (``vendor/``: the npm package ``plotly.js-cartesian-dist-min`` as published, with its MIT
license), not fetched at install: a wheel or an offline install must hold it, and ``pip install`` runs no npm. Its
version must be the one plotly.py was built against (the figures' JSON, typed arrays among it, is plotly.py's): when
the installed plotly.py ships another plotly.js, ``bundle()`` is None and the full bundle serves, as before. To
update it with plotly.py: ``npm pack plotly.js-cartesian-dist-min@$(python -c "import plotly.offline as o;
print(o.get_plotlyjs_version())")``, and copy ``plotly-cartesian.min.js`` and ``LICENSE`` from the package here.
"""

from __future__ import annotations

import functools
import os
import re

# the trace types the figures (figures.py, rank_views.py) use; the cartesian bundle also holds box, contour,
# histogram, histogram2d, histogram2dcontour, image, pie, scatterternary and violin
TRACE_TYPES = ("scatter", "bar", "heatmap")
BUNDLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor", "plotly-cartesian.min.js")
# where Dash's renderer fetches plotly.js from when it serves its files itself (hard-coded in dash-renderer)
DASH_PATH = "_dash-component-suites/plotly/package_data/plotly.min.js"


@functools.lru_cache(maxsize=1)
def bundle_version() -> str | None:
    """The vendored bundle's plotly.js version (from its header, ``plotly.js (cartesian - minified) v4.1.1``)."""
    try:
        with open(BUNDLE, encoding="utf-8") as f:
            head = f.read(200)
    except OSError:
        return None
    m = re.search(r"plotly\.js \(cartesian[^)]*\) v(\d+\.\d+\.\d+\S*)", head)
    return m.group(1) if m else None


def plotly_version() -> str:
    """The plotly.js version the installed plotly.py ships (and writes its figures' JSON for)."""
    from plotly.offline import get_plotlyjs_version

    return str(get_plotlyjs_version())


def bundle() -> str | None:
    """The path of the partial bundle when it is the plotly.js of the installed plotly.py, else None (the full
    bundle then serves; as it does with AMPDOCTOR_PLOTLYJS=full in the environment: benchmarks/dashboard.py measures
    both side by side)."""
    if os.environ.get("AMPDOCTOR_PLOTLYJS", "").strip().lower() == "full":
        return None
    v = bundle_version()
    return BUNDLE if v is not None and v == plotly_version() else None


def source() -> str:
    """plotly.js as the report embeds it: the partial bundle (``bundle()``), else plotly.py's full one."""
    path = bundle()
    if path is None:
        from plotly.offline import get_plotlyjs

        return str(get_plotlyjs())
    return _read(path)


@functools.lru_cache(maxsize=1)
def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
