"""ampdoctor.dashboards: the Dash app (ampdoctor serve) and the figure builders shared with the report."""
