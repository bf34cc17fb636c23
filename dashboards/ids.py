"""Component ids: one table, shared by the layouts, the callbacks, the browser script (assets/) and the tests."""

URL = "url"
URL_STATE = "url-state"  # the view's settings written to the address bar (no navigation)
URL_WANT = "url-want"  # a view's address-bar write, applied only while its page is the current one
POLL = "poll"
VERSION = "trace-version"
HEADER = "header"
STATUS = "status"  # what runs in the background for this run ("diagnosing: 3 s")
PAGE = "page"
ERROR = "page-error"  # what went wrong in a callback, in words
RUN_PICKER = "run-picker"
NAV = "nav"

# overview
SUMMARY = "overview-summary"
FINDINGS = "overview-findings"
LOSS_GRAPH = "overview-loss"
SCALE_GRAPH = "overview-scale"
NORM_GRAPH = "overview-norm"
TIME_GRAPH = "overview-time"
METRIC_GRAPH = "overview-metric"
METRIC_PICK = "overview-metric-pick"
STEP_COUNT = "overview-step-count"
SMOOTHING = "overview-smoothing"
LOG_Y = "overview-log-y"
RESET_ZOOM = "reset-zoom"

# layers
LAYERS_KIND = "layers-kind"
LAYERS_STAT = "layers-stat"
LAYERS_SORT = "layers-sort"
LAYERS_SEARCH = "layers-search"
LAYERS_GROUP = "layers-group"
LAYERS_SCALE = "layers-scale"
LAYERS_ONLY = "layers-only"
LAYERS_PAGE = "layers-page"
LAYERS_HEATMAP = "layers-heatmap"
LAYERS_LIST = "layers-list"
LAYERS_COUNT = "layers-count"

# layer detail
LAYER_TITLE = "layer-title"
LAYER_STAT = "layer-stat"
LAYER_HIST = "layer-hist"
LAYER_SERIES = "layer-series"
LAYER_FINDINGS = "layer-findings"

# precision map
PRECISION_TABLE = "precision-table"
PRECISION_SEARCH = "precision-search"
PRECISION_ONLY = "precision-only"
PRECISION_SUMMARY = "precision-summary"
PRECISION_PAGE = "precision-page"

# what-if
WHATIF_INIT = "whatif-init-scale"
WHATIF_INTERVAL = "whatif-growth-interval"
WHATIF_GROWTH = "whatif-growth-factor"
WHATIF_BACKOFF = "whatif-backoff-factor"
WHATIF_GRAPH = "whatif-graph"
WHATIF_SUMMARY = "whatif-summary"
WHATIF_NOTE = "whatif-note"
WHATIF_SUGGESTIONS = "whatif-suggestions"

# compare
COMPARE_OTHER = "compare-other"
COMPARE_STAT = "compare-stat"
COMPARE_LOSS = "compare-loss"
COMPARE_LAYERS = "compare-layers"

# formats
FORMATS_VERDICT = "formats-verdict"
FORMATS_PROBE = "formats-probe"
FORMATS_SHARES = "formats-shares"
FORMATS_TABLE = "formats-table"
FORMATS_BY = "formats-by"
FORMATS_SEARCH = "formats-search"

# ranks
RANKS_STAT = "ranks-stat"
RANKS_GRAPH = "ranks-graph"
RANKS_TABLE = "ranks-table"

# per page, the store of the step range all its step charts show ({"x0", "x1"}, or null: the whole run)
ZOOMS = {
    "/": "overview-zoom",
    "/layers": "layers-zoom",
    "/layer": "layer-zoom",
    "/whatif": "whatif-zoom",
    "/compare": "compare-zoom",
    "/ranks": "ranks-zoom",
}
# the step charts of each page, whose x axes zoom together
STEP_GRAPHS = {
    "/": (LOSS_GRAPH, SCALE_GRAPH, NORM_GRAPH, TIME_GRAPH, METRIC_GRAPH),
    "/layers": (LAYERS_HEATMAP,),
    "/layer": (LAYER_SERIES, LAYER_HIST),
    "/whatif": (WHATIF_GRAPH,),
    "/compare": (COMPARE_LOSS,),
    "/ranks": (RANKS_GRAPH,),
}
