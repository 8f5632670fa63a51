#pragma once
#include "cublas_api.h"
