# FA4 (flash-attn-4 and its cutlass-dsl wheels) unpacked into /tmp/fa4, which run.sh then puts on PYTHONPATH
# for the steps after it. It comes in two carried parts over two back-to-back calls on one warm machine
# (benchmarks/device/README.md): .fa4a/ (the small wheels and cu13.part00), then .fa4b/ (cu13.part01).
mkdir -p /tmp/fa4
if [ -d .fa4a ]; then
  for w in .fa4a/*.whl; do python3 -m zipfile -e "$w" /tmp/fa4; done  # one tree: they share nvidia_cutlass_dsl/
  cp .fa4a/cu13.part00 /tmp/
fi
if [ -d .fa4b ]; then
  [ -f /tmp/cu13.part00 ] || { echo "no /tmp/cu13.part00: the .fa4a call's machine is gone"; exit 3; }
  cat /tmp/cu13.part00 .fa4b/cu13.part01 | tar xJf - -C /tmp/fa4 || exit 1
  for w in .fa4b/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/fa4; done  # wheels that did not fit in .fa4a
fi
PYTHONPATH=/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:/tmp/fa4:$PYTHONPATH python3 -c "import flash_attn.cute; print('fa4 import ok')" 2>&1 | tail -1
