"""What acts on a float8 recipe (``policy.float8.Float8Recipe``, the value): one scaling model
(``scaling``), apply's conversion and the one leave-out filter (``convert``), compare's emulation
(``emulate``) and forecast's scores (``score``). Below ``applied``, above ``policy``."""
