"""The MLA kernels: the Triton kernel and its wrapper (``attention``), the Gluon kernels for sm_90:
their entry points (``prologue``), the wgmma kernel's body (``wgmma``) and the warp-specialized
kernels' partitions (``seesaw``, ``chunked``, ``dbuf``, ``swap``; what they share: ``warpspec``)."""
