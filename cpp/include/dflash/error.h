#pragma once
// Every problem with user input (files, arguments) surfaces as dflash::Error,
// whose message names the file, key or tensor and what was expected. Nothing
// in this library aborts on file content.
#include <stdexcept>
#include <string>

namespace dflash {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

}  // namespace dflash
