"""The MLA kernels: the Triton kernel and its wrapper (``attention``), the Gluon kernels for sm_90
(``wgmma``; the warp-specialized ``seesaw``, ``chunked``, ``dbuf`` and ``swap``, which share
``warpspec``)."""
