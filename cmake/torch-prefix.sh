# Sourced by dev.sh and install-deps.sh. torch_cmake_prefix prints the CMake
# prefix of a Python PyTorch that ships libtorch's CMake files
# (<prefix>/Torch/TorchConfig.cmake, as pip's wheels do; on a GPU machine that
# libtorch has CUDA), and prints nothing otherwise: Debian's python3-torch has
# no CMake files, and then the distribution's libtorch-dev provides them.
torch_cmake_prefix() {
  local prefix
  prefix=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || return 0
  if [ -n "$prefix" ] && [ -f "$prefix/Torch/TorchConfig.cmake" ]; then printf '%s\n' "$prefix"; fi
}
