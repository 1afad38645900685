"""All-gather sessions, reduce-scatter and all-reduce inside one NVLink domain."""
