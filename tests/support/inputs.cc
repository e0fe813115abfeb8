#include "tests/support/inputs.h"

namespace bulkhead::testing {

at::Generator sharedGenerator(int salt) { return at::detail::createCPUGenerator(0x5eed0000ULL + salt); }

at::Tensor draw(int rank, int salt, at::IntArrayRef shape, at::ScalarType dtype, bool forProduct) {
  auto generator = at::detail::createCPUGenerator(1000003ULL * (rank + 1) + 7919ULL * salt);
  bool floating = at::isFloatingType(dtype);
  at::Tensor values;
  if (forProduct) {
    at::Tensor choices = floating ? at::tensor({-2.0, -1.0, -0.5, 0.5, 1.0, 2.0}, at::kDouble)
                                  : at::tensor({-2.0, -1.0, 1.0, 2.0}, at::kDouble);
    values = choices.index_select(0, at::randint(choices.numel(), shape, generator, at::kLong).flatten()).view(shape);
  } else if (floating) {
    values = at::randint(-8, 8, shape, generator, at::kDouble) / 4;
  } else if (dtype == at::kByte) {
    values = at::randint(0, 16, shape, generator, at::kDouble);
  } else {
    values = at::randint(-8, 8, shape, generator, at::kDouble);
  }
  return values.to(dtype);
}

std::vector<at::ScalarType> supportedDtypes() {
  return {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong, at::kChar, at::kByte};
}

at::Tensor gaussian(int salt, at::IntArrayRef shape) { return at::randn(shape, sharedGenerator(salt), at::kDouble); }

}  // namespace bulkhead::testing
