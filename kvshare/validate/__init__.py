"""``kvshare validate``: the validation ladder (bytes, helpers, full pool, service) and the serving audit."""
