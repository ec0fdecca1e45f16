"""The maintainers' tooling: keeping the series (vendor, export, regen, graft-tests), proving it
(prove, test, status), checking it as upstream's CI would (lint-patches), sending it upstream
(upstream, suites) and the generated docs (docs). The modules one level up are what users run,
from a clone or an installed fork: `apply` / `unapply` (checkout.py), `info` (installed.py) and
`audit` (audit/), with the core they share with these (manifest, series, sources, git)."""
