"""Component ids: one table, shared by the layouts, the callbacks and the browser tests."""

URL = "url"
POLL = "poll"
VERSION = "trace-version"
HEADER = "header"
PAGE = "page"
ERROR = "page-error"  # what went wrong in a callback, in words
RUN_PICKER = "run-picker"
NAV = "nav"

# overview
SUMMARY = "overview-summary"
FINDINGS = "overview-findings"
LOSS_GRAPH = "overview-loss"
SCALE_GRAPH = "overview-scale"
TIME_GRAPH = "overview-time"
STEP_COUNT = "overview-step-count"

# layers
LAYERS_KIND = "layers-kind"
LAYERS_STAT = "layers-stat"
LAYERS_SORT = "layers-sort"
LAYERS_HEATMAP = "layers-heatmap"
LAYERS_LIST = "layers-list"

# layer detail
LAYER_TITLE = "layer-title"
LAYER_HIST = "layer-hist"
LAYER_SERIES = "layer-series"
LAYER_FINDINGS = "layer-findings"

# precision map
PRECISION_TABLE = "precision-table"

# what-if
WHATIF_INIT = "whatif-init-scale"
WHATIF_INTERVAL = "whatif-growth-interval"
WHATIF_GROWTH = "whatif-growth-factor"
WHATIF_BACKOFF = "whatif-backoff-factor"
WHATIF_GRAPH = "whatif-graph"
WHATIF_SUMMARY = "whatif-summary"

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
