"""Tenants as metric labels and report groups: a bounded set of names.

A request's tenant is the name of its API key in the keys file (the API server's middleware writes
it, overwriting anything a client sent, so only names from the file reach the engine). A request
without one belongs to the default tenant :data:`DEFAULT_TENANT`. The runtime's per-tenant series
give each of the first :data:`MAX_TENANT_LABELS` distinct tenants it sees a label of its own and
count every later one under :data:`OTHER_TENANT`, so the number of series stays bounded whatever
the file holds. A keys-file entry named ``default`` or ``other`` would share its label with those
groups: :data:`RESERVED_TENANT_NAMES` lists the names an entry should not take.

Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

#: The tenant of a request without a named key (and of a record without a tenant).
DEFAULT_TENANT = "default"
#: The label of every tenant past the first :data:`MAX_TENANT_LABELS`.
OTHER_TENANT = "other"
#: Names a keys-file entry should not take (its series would merge with the groups above).
RESERVED_TENANT_NAMES = (DEFAULT_TENANT, OTHER_TENANT)
#: Distinct tenants with a label of their own on ``/metrics`` (besides ``default`` and ``other``).
MAX_TENANT_LABELS = 64


def tenant_group(tenant: Any) -> str:
    """The group of a record's ``tenant`` value: the name itself, or :data:`DEFAULT_TENANT` for a
    record without one (``null``, absent, empty or not a string)."""
    return tenant if isinstance(tenant, str) and tenant else DEFAULT_TENANT


def tenant_label(tenant: str | None, labelled: Collection[str], cap: int = MAX_TENANT_LABELS) -> str:
    """The metric label for ``tenant``, given the tenants already ``labelled`` (in the order first seen).

    No tenant is :data:`DEFAULT_TENANT`; a tenant already labelled keeps its label; a new one gets its
    own while fewer than ``cap`` are labelled, else :data:`OTHER_TENANT`. The caller adds a new
    name the answer returns to ``labelled``."""
    group = tenant_group(tenant)
    if group in RESERVED_TENANT_NAMES or group in labelled:
        return group
    return group if len(labelled) < cap else OTHER_TENANT
